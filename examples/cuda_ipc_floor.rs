//! What two processes sharing one GPU pay to alternate GPU work, with no actorpipe pipe on the
//! path (feature `cuda`; docs/performance.md, "CUDA channels").
//!
//! This program starts a copy of itself; the two connect over a Unix socket and exchange the
//! handles of one interprocess event each. Each round trip is two turns, one per process; in a
//! turn a process copies 4 KiB on its own stream, hands over by writing one byte on the socket,
//! and the other process takes its turn. Four ways of ordering the turns are measured:
//!
//! - `synchronize`: copy, record an event, the CPU waits for it (`cuEventSynchronize`);
//! - `gpu-wait`: the stream waits on the other process's interprocess event on the GPU
//!   (`cuStreamWaitEvent`), then copies and records its own (what `cuda_ipc` does);
//! - `query`: the CPU polls the other process's event (`cuEventQuery`), then copies and records;
//! - `host-function`: copy, then a host function (`cuLaunchHostFunc`) tells the CPU.
//!
//! Run: `cargo run --release --example cuda_ipc_floor --features cuda` (with and without MPS).
//! Without a GPU it says so and exits 0.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::Instant;

use actorpipe::cuda::{self, sys, CudaBuffer};
use actorpipe::internal::backend::cuda_ipc::ipc;

const ROUND_TRIPS: usize = 400;
const LEN: usize = 4096;
const CHILD: &str = "ACTORPIPE_IPC_FLOOR_CHILD";
const MODES: [&str; 4] = ["synchronize", "gpu-wait", "query", "host-function"];

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

fn tick(s: &mut UnixStream) -> Result<()> {
    s.write_all(&[1])?;
    Ok(())
}

fn tock(s: &mut UnixStream) -> Result<()> {
    let mut b = [0u8; 1];
    s.read_exact(&mut b)?;
    Ok(())
}

/// A host function that only sends on a channel.
fn host_function(stream: &cuda::CudaStream) -> Result<std::sync::mpsc::Receiver<()>> {
    type Job = std::sync::mpsc::Sender<()>;
    unsafe extern "C" fn run(data: *mut std::ffi::c_void) {
        // SAFETY: `data` is the boxed sender leaked below, run exactly once by the driver.
        let tx = unsafe { Box::from_raw(data.cast::<Job>()) };
        let _ = tx.send(());
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let data = Box::into_raw(Box::new(tx)).cast::<std::ffi::c_void>();
    // SAFETY: `run` matches the host-function signature and takes `data` back exactly once.
    let r = unsafe { sys::cuLaunchHostFunc(stream.cu_stream(), Some(run), data) };
    if r != sys::CUresult::CUDA_SUCCESS {
        // SAFETY: not enqueued, so the driver will never call `run`: take the box back.
        drop(unsafe { Box::from_raw(data.cast::<Job>()) });
        return Err(format!("cuLaunchHostFunc: {r:?}").into());
    }
    Ok(rx)
}

fn main() -> Result<()> {
    if let Err(why) = cuda::available() {
        println!("no CUDA GPU here ({why}): nothing to measure");
        return Ok(());
    }
    let child = std::env::var_os(CHILD).is_some();
    let path = std::env::temp_dir().join("actorpipe-ipc-floor.sock");
    let gpu = cuda::gpu(0)?;
    gpu.bind()?;
    let stream = gpu.lease_stream()?;
    let (a, b) = (CudaBuffer::alloc(0, LEN)?, CudaBuffer::alloc(0, LEN)?);
    let mine = gpu.event(true)?;
    let plain = gpu.event(false)?;
    let mut s = if child {
        UnixStream::connect(&path)?
    } else {
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path)?;
        std::process::Command::new(std::env::current_exe()?)
            .env(CHILD, "1")
            .spawn()?;
        let s = listener.accept()?.0;
        let _ = std::fs::remove_file(&path);
        s
    };
    s.write_all(&ipc::export_event(&mine)?)?;
    let mut theirs = [0u8; ipc::HANDLE_LEN];
    s.read_exact(&mut theirs)?;
    let peer = ipc::open_event(&gpu, &theirs)?;
    mine.record(&stream)?;
    stream.synchronize()?;
    let copy = || {
        // SAFETY: both buffers are LEN bytes of device 0, alive until the end.
        unsafe { cuda::copy_async((b.device_ptr(), &gpu), (a.device_ptr(), &gpu), LEN, &stream) }
    };
    // One turn of this process.
    let turn = |mode: &str| -> Result<()> {
        match mode {
            "synchronize" => {
                copy()?;
                plain.record(&stream)?;
                plain.synchronize()?;
            }
            "gpu-wait" => {
                peer.wait_on(&stream)?;
                copy()?;
                mine.record(&stream)?;
            }
            "query" => {
                while !peer.is_complete()? {}
                copy()?;
                mine.record(&stream)?;
            }
            _ => {
                copy()?;
                host_function(&stream)?.recv()?;
            }
        }
        Ok(())
    };
    if !child {
        println!(
            "two processes alternating a {LEN}-byte copy on GPU 0, {ROUND_TRIPS} round trips each"
        );
    }
    for mode in MODES {
        let mut times = Vec::with_capacity(ROUND_TRIPS);
        for _ in 0..ROUND_TRIPS {
            let t = Instant::now();
            if child {
                tock(&mut s)?;
                turn(mode)?;
                tick(&mut s)?;
                continue;
            }
            turn(mode)?;
            tick(&mut s)?;
            tock(&mut s)?;
            // The child's GPU work is part of the round trip: wait for it here.
            match mode {
                "gpu-wait" => {
                    peer.wait_on(&stream)?;
                    plain.record(&stream)?;
                    plain.synchronize()?;
                }
                "query" => while !peer.is_complete()? {},
                _ => {}
            }
            times.push(t.elapsed().as_secs_f64() * 1e6);
        }
        stream.synchronize()?;
        if !child {
            times.sort_by(f64::total_cmp);
            println!(
                "{mode:14} p50 {:7.1} us   p10 {:7.1} us   p90 {:7.1} us",
                times[ROUND_TRIPS / 2],
                times[ROUND_TRIPS / 10],
                times[9 * ROUND_TRIPS / 10]
            );
        }
        tick(&mut s)?;
        tock(&mut s)?;
    }
    Ok(())
}
