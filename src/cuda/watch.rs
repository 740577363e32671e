//! The device's watcher: runs a callback once the work queued on a stream so far has run,
//! without a host function (what [`super::on_stream_done`] is built on).
//!
//! `cuLaunchHostFunc` was the first way: simple, but the stream stops at the host function until
//! a driver thread has run it, so the copy after it waits, and the context stays busy, which
//! between processes sharing a GPU (time-sliced contexts, no MPS) delays the other process's
//! work until the time slice ends. Measured on an H100 (two processes alternating a 4 KiB copy,
//! docs/performance.md "CUDA between processes"): a host function per turn instead of a
//! synchronized event made the round trip 1.8x as long without MPS and 2.5x with it.
//!
//! So instead: a pooled blocking-sync event is recorded on the stream (the stream never stops),
//! and the device's watcher thread waits for it and runs the callback. The thread sleeps on its
//! queue when nothing is pending (no busy thread); with work pending it polls the pending
//! events for up to [`SPIN`], yielding between polls, then sleeps in `cuEventSynchronize` on the
//! oldest (a blocking-sync event: the driver wakes it on the GPU's interrupt).
//!
//! Callbacks run in completion order as the watcher sees it; one whose event completes while
//! the thread sleeps on an older one runs when that one completes. A callback must be short and
//! must not call the CUDA API (the channels' callbacks post to a queue).

use std::collections::VecDeque;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::pool::{Event, Kind};
use super::{CudaStream, Gpu};

/// How long the watcher polls before sleeping on the oldest pending event, unless
/// `ACTORPIPE_CUDA_WATCH_SPIN_US` says otherwise.
pub(crate) const SPIN: Duration = Duration::from_micros(20);

fn spin() -> Duration {
    static SPIN_US: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *SPIN_US.get_or_init(|| {
        std::env::var("ACTORPIPE_CUDA_WATCH_SPIN_US")
            .ok()
            .and_then(|v| v.parse().ok())
            .map_or(SPIN, Duration::from_micros)
    })
}

type Callback = Box<dyn FnOnce() + Send>;

/// The sending end of a device's watcher thread (the thread ends when the `Gpu` is dropped,
/// which, since every `Gpu` lives in the process-wide map, is at exit).
pub(crate) struct Watcher {
    jobs: std::sync::Mutex<mpsc::Sender<(Event, Callback)>>,
}

impl Watcher {
    fn start(ordinal: u32) -> crate::Result<Watcher> {
        let (tx, rx) = mpsc::channel();
        std::thread::Builder::new()
            .name(format!("actorpipe-cuda{ordinal}-watch"))
            .spawn(move || run(rx))
            .map_err(|e| {
                crate::Error::io("starting the CUDA watcher thread", e, &Default::default())
            })?;
        Ok(Watcher {
            jobs: std::sync::Mutex::new(tx),
        })
    }
}

/// Queues `f` to run once the work queued on `stream` so far has run.
pub(crate) fn after(
    gpu: &Arc<Gpu>,
    stream: &CudaStream,
    f: impl FnOnce() + Send + 'static,
) -> crate::Result<()> {
    let watcher = match gpu.watcher.get() {
        Some(w) => w,
        None => {
            let w = Watcher::start(gpu.ordinal())?;
            // Another thread may have won the race: its watcher is used, ours ends at once
            // (its queue is dropped here).
            let _ = gpu.watcher.set(w);
            gpu.watcher.get().expect("set above")
        }
    };
    let event = gpu.event_of(Kind::Blocking)?;
    event.record(stream)?;
    watcher
        .jobs
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .send((event, Box::new(f)))
        .map_err(|_| crate::Error::Device {
            detail: format!("the watcher thread of cuda:{} has ended", gpu.ordinal()),
            origin: Default::default(),
        })
}

/// The watcher thread.
fn run(rx: mpsc::Receiver<(Event, Callback)>) {
    let spin = spin();
    let mut pending: VecDeque<(Event, Callback)> = VecDeque::new();
    loop {
        if pending.is_empty() {
            match rx.recv() {
                Ok(job) => pending.push_back(job),
                Err(_) => return,
            }
        }
        let mut since = Instant::now();
        while !pending.is_empty() {
            pending.extend(rx.try_iter());
            let before = pending.len();
            // Run every callback whose event has completed; a failed query (a context in error)
            // runs it too: its copy will never run, and the channel's own error path (the
            // completion's wait, the peer's lost acknowledgement) reports the failure.
            pending.retain_mut(|(event, callback)| {
                if event.is_complete().unwrap_or(true) {
                    let f = std::mem::replace(callback, Box::new(|| {}));
                    // A panic must not end the thread: the other callbacks would never run.
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
                    false
                } else {
                    true
                }
            });
            if pending.len() < before {
                since = Instant::now();
                continue;
            }
            if since.elapsed() < spin {
                std::thread::yield_now();
                continue;
            }
            if let Some((event, _)) = pending.front() {
                if let Err(e) = event.synchronize() {
                    tracing::debug!(error = %e, "cuda watcher: synchronize failed");
                }
            }
            since = Instant::now();
        }
    }
}
