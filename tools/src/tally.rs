//! A run's bookkeeping, shared by the actors that ping (`fired::Pinger`) and the handlers that
//! do (`handler`): the round trips' clock and samples, the end of the run, and the watchdog
//! that ends a run whose round trips stopped.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actorpipe::Allocation;
use tokio::sync::oneshot;

use crate::bench::{same_bytes, Buffers};
use crate::failure::Failure;
use crate::measure::{Counts, Samples};
use crate::report::Progress;

/// How long one round trip may take before the run gives up.
const ROUND_TRIP_LIMIT: Duration = Duration::from_secs(60);

/// Waits for a run's samples on `rx`. A round trip that never ends must end the run, not hang
/// it: `trips` (the round trips so far) has to move at least once per [`ROUND_TRIP_LIMIT`]. The
/// watchdog is a task of its own: an interval on the pinging actor would be polled at every
/// completion it handles.
pub async fn watch(
    mut rx: oneshot::Receiver<Result<(Samples, Buffers), Failure>>,
    trips: &AtomicU32,
    size: u64,
) -> Result<(Samples, Buffers), Failure> {
    let mut seen = 0;
    loop {
        match tokio::time::timeout(ROUND_TRIP_LIMIT, &mut rx).await {
            Ok(done) => {
                return done.unwrap_or_else(|_| Err(Failure::Failed("the pinger stopped".into())))
            }
            Err(_) => {
                let now = trips.load(Ordering::Relaxed);
                if now == seen {
                    return Err(Failure::Failed(format!(
                        "no echo of {size} bytes within {ROUND_TRIP_LIMIT:?}"
                    )));
                }
                seen = now;
            }
        }
    }
}

/// A run's bookkeeping: the clock of the round trip in flight, the samples, the count.
pub struct Tally {
    size: u64,
    counts: Counts,
    progress: Progress,
    start: Instant,
    trips: u32,
    /// `trips`, for the watchdog ([`watch`]).
    shared_trips: Arc<AtomicU32>,
    samples: Samples,
}

/// What comes after a round trip.
pub enum Next {
    /// Another: send `sent` again, read into `back`'s buffers.
    Again {
        sent: actorpipe::Message,
        back: actorpipe::Message,
    },
    /// The run is over: its samples and buffers, or why it failed.
    Done(Result<(Samples, Buffers), Failure>),
}

impl Tally {
    /// The bookkeeping of a run of `counts` round trips of `size` bytes, and its trip count
    /// for [`watch`].
    pub fn new(size: u64, counts: Counts, progress: &Progress) -> (Tally, Arc<AtomicU32>) {
        let trips = Arc::new(AtomicU32::new(0));
        let tally = Tally {
            size,
            counts,
            progress: progress.clone(),
            start: Instant::now(),
            trips: 0,
            shared_trips: trips.clone(),
            samples: Samples::with_capacity(counts.iters as usize),
        };
        (tally, trips)
    }

    /// A round trip starts now.
    pub fn start(&mut self) {
        self.start = Instant::now();
    }

    /// Once a round trip's write and read are both back (`sent` and `back` hold them; else
    /// `None`): records it, and says whether another follows (the last one's echo is checked
    /// against what was sent).
    pub fn ended(
        &mut self,
        sent: &mut Option<actorpipe::Message>,
        back: &mut Option<actorpipe::Message>,
    ) -> Option<Next> {
        if sent.is_none() || back.is_none() {
            return None;
        }
        let (sent, back) = (sent.take().expect("sent"), back.take().expect("back"));
        let took = self.start.elapsed();
        if self.trips >= self.counts.warmup {
            self.samples.push(took);
        }
        self.trips += 1;
        self.shared_trips.store(self.trips, Ordering::Relaxed);
        self.progress.inc();
        if self.trips < self.counts.total() {
            return Some(Next::Again { sent, back });
        }
        Some(Next::Done(if same_bytes(&sent, &back) {
            let buffers = Buffers {
                size: self.size,
                message: sent,
                spare: Some(Allocation::from(back)),
            };
            Ok((std::mem::take(&mut self.samples), buffers))
        } else {
            Err(Failure::Failed(format!(
                "the echo of {} bytes differs from what was sent",
                self.size
            )))
        }))
    }
}
