//! The device's watcher: runs a callback once the work queued on a stream so far has run,
//! without a host function (what [`super::on_stream_done`] is built on).
//!
//! `cuLaunchHostFunc` was the first way: simple, but the stream stops at the host function until
//! a driver thread has run it, so the copy after it waits, and the context stays busy, which
//! between processes sharing a GPU (time-sliced contexts, no MPS) delays the other process's
//! work until the time slice ends. Measured on an H100 (`examples/cuda_ipc_floor.rs`, two
//! processes alternating a 4 KiB copy; docs/performance.md, "CUDA channels"): a
//! host function per turn instead of a synchronized event made the round trip 1.8x as long
//! without MPS and 3.7x with it.
//!
//! So instead: a pooled event is recorded on the stream (the stream never stops), and the
//! device's watcher thread polls it and runs the callback once it has completed. The thread
//! sleeps on its queue when nothing is pending (no busy thread). With work pending it polls every
//! pending event, yielding between polls, for [`SPIN`] after the last completion or new job;
//! then it naps between polls, 10 µs at first and half again as long each time (at most 1 ms),
//! woken early by a new job. So a completion is seen within about half the time it took, and a
//! long wait costs a few wake-ups per millisecond.
//!
//! It never blocks in `cuEventSynchronize`: an event that never completes (a stream waiting on an
//! interprocess event of a process that died before recording it, a user's stream stuck on its
//! own work) would then stop every other callback of the device. Such a callback simply stays
//! pending; the others run. Callbacks of one stream run in order. A callback must be short and
//! must not call the CUDA API (the channels' callbacks post to a queue).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::pool::Event;
use super::{CudaStream, Gpu};

/// How long the watcher polls without napping after the last completion or new job, unless
/// [`set_spin`] says otherwise.
pub const SPIN: Duration = Duration::from_micros(20);

/// The spin [`set_spin`] asked for, in nanoseconds; `u64::MAX`: not set ([`SPIN`]).
static SPIN_NS: AtomicU64 = AtomicU64::new(u64::MAX);

/// Sets how long each device's watcher thread polls without napping after its last completion
/// or new job ([`SPIN`] by default), for watchers started afterwards: each device's starts at
/// its first stream callback and runs for the life of the process.
pub fn set_spin(spin: Duration) {
    let ns = u64::try_from(spin.as_nanos()).unwrap_or(u64::MAX - 1);
    SPIN_NS.store(ns, Ordering::Relaxed);
}

/// The spin a watcher starting now uses.
pub fn spin() -> Duration {
    match SPIN_NS.load(Ordering::Relaxed) {
        u64::MAX => SPIN,
        ns => Duration::from_nanos(ns),
    }
}

type Callback = Box<dyn FnOnce() + Send>;

/// What the watcher waits for: a pooled event on the GPU (a flag in the unit tests).
trait Pending: Send + 'static {
    /// Whether the work has completed; a failed query counts as completed.
    fn done(&self) -> bool;
}

impl Pending for Event {
    fn done(&self) -> bool {
        self.is_complete().unwrap_or(true)
    }
}

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
            .spawn(move || run(rx, spin()))
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
    let event = gpu.event(false)?;
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

/// The first nap once the spin is over, and the longest.
const FIRST_NAP: Duration = Duration::from_micros(10);
const LONGEST_NAP: Duration = Duration::from_millis(1);

/// The watcher thread.
fn run<P: Pending>(rx: mpsc::Receiver<(P, Callback)>, spin: Duration) {
    let mut pending: VecDeque<(P, Callback)> = VecDeque::new();
    loop {
        if pending.is_empty() {
            match rx.recv() {
                Ok(job) => pending.push_back(job),
                Err(_) => return,
            }
        }
        let mut since = Instant::now();
        let mut nap = Duration::ZERO;
        while !pending.is_empty() {
            let queued = pending.len();
            pending.extend(rx.try_iter());
            let before = pending.len();
            // Run every callback whose event has completed; a failed query (a context in error)
            // runs it too: its copy will never run, and the channel's own error path (the
            // completion's wait, the peer's lost acknowledgement) reports the failure.
            pending.retain_mut(|(event, callback)| {
                if event.done() {
                    let f = std::mem::replace(callback, Box::new(|| {}));
                    // A panic must not end the thread: the other callbacks would never run.
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
                    false
                } else {
                    true
                }
            });
            if pending.len() < before || before > queued {
                since = Instant::now();
                nap = Duration::ZERO;
                continue;
            }
            if since.elapsed() < spin {
                std::thread::yield_now();
                continue;
            }
            nap = if nap.is_zero() {
                FIRST_NAP
            } else {
                (nap * 3 / 2).min(LONGEST_NAP)
            };
            match rx.recv_timeout(nap) {
                // A new job may be a short one: spin again.
                Ok(job) => {
                    pending.push_back(job);
                    since = Instant::now();
                    nap = Duration::ZERO;
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                // The device is gone (process exit): drain what is pending.
                Err(mpsc::RecvTimeoutError::Disconnected) => std::thread::sleep(nap),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    struct Flag(Arc<AtomicBool>);

    impl Pending for Flag {
        fn done(&self) -> bool {
            self.0.load(Ordering::Acquire)
        }
    }

    fn flag(done: bool) -> (Flag, Arc<AtomicBool>) {
        let f = Arc::new(AtomicBool::new(done));
        (Flag(f.clone()), f)
    }

    #[test]
    fn a_stuck_job_holds_up_no_other_and_late_ones_run() {
        let (jobs, rx) = mpsc::channel::<(Flag, Callback)>();
        let (ran, ran_rx) = mpsc::channel();
        let thread = std::thread::spawn(move || run(rx, Duration::from_micros(20)));
        let job = |name: &'static str, done: bool| {
            let (f, set) = flag(done);
            let ran = ran.clone();
            jobs.send((f, Box::new(move || ran.send(name).unwrap())))
                .unwrap();
            set
        };
        let _stuck = job("stuck", false);
        job("a", true);
        job("b", true);
        let late = job("late", false);
        let got: Vec<_> = (0..2).map(|_| ran_rx.recv().unwrap()).collect();
        assert_eq!(
            got,
            ["a", "b"],
            "completed jobs run in order, past the stuck one"
        );
        // Long enough for the watcher to be napping at its longest.
        std::thread::sleep(Duration::from_millis(30));
        assert!(ran_rx.try_recv().is_err(), "nothing else has completed");
        late.store(true, Ordering::Release);
        let t = Instant::now();
        assert_eq!(ran_rx.recv_timeout(Duration::from_secs(5)).unwrap(), "late");
        assert!(
            t.elapsed() < Duration::from_millis(500),
            "seen within a few naps"
        );
        // A new job is picked up at once even while the stuck one keeps it napping.
        job("new", true);
        assert_eq!(ran_rx.recv_timeout(Duration::from_secs(5)).unwrap(), "new");
        drop(jobs);
        drop(ran);
        // The stuck job keeps the thread polling; it does not end while work is pending.
        assert!(!thread.is_finished());
    }

    #[test]
    fn a_panicking_callback_does_not_end_the_thread() {
        let (jobs, rx) = mpsc::channel::<(Flag, Callback)>();
        let thread = std::thread::spawn(move || run(rx, Duration::from_micros(20)));
        jobs.send((flag(true).0, Box::new(|| panic!("callback"))))
            .unwrap();
        let (ran, ran_rx) = mpsc::channel();
        jobs.send((flag(true).0, Box::new(move || ran.send(()).unwrap())))
            .unwrap();
        ran_rx.recv_timeout(Duration::from_secs(5)).unwrap();
        drop(jobs);
        thread.join().unwrap();
    }
}
