//! What the endpoint's progress passes keep between them, shared by the actor and its spin
//! task ([`super::spin::Spinner`]): both run on the actor's thread, one at a time, so a
//! `RefCell` holds it.

use std::sync::{Arc, Mutex};
use std::task::Waker;
use std::time::{Duration, Instant};

use super::metrics::EndpointMetrics;
use super::poster::{lock, Core};
use super::EndpointConfig;

/// A poll past the spin window sleeps this share of the quiet so far.
const QUIET_SHARE: u32 = 8;

/// How long a poll past the spin window sleeps after a quiet of `quiet` (no completion or post):
/// `quiet / 8` within `min_sleep` (at least a microsecond) and `max_sleep`. So a message that
/// lands after a quiet of `q` waits at most `q / 8` (or `max_sleep`) to be read: a 1 MiB
/// tensor's round trip on the `shm` provider, whose sides wait a few hundred microseconds each
/// for the other's copy, took eight times the raw ping-pong while every poll past the window
/// slept 1 ms (git history's docs/efa-measurements.md, "Between 64 B and 64 MiB"). In steady idleness it is
/// `max_sleep`, as before: the idle cost did not move.
pub(super) fn poll_sleep(config: &EndpointConfig, quiet: Duration) -> Duration {
    let least = config.min_sleep.max(Duration::from_micros(1));
    (quiet / QUIET_SHARE).clamp(least, config.max_sleep.max(least))
}

/// When ops last moved on an endpoint. Where no spin window applies while nothing is
/// backlogged (a wait fd and no `busy_poll`), an activity is not stamped with the clock at once
/// but at the next look at a window, if one comes (a backlog: its post or retry is itself
/// such an activity, a moment before): in a VM a clock read costs as much as the rest of a
/// pass's bookkeeping, and that mode reads the clock for nothing else.
pub(super) struct Stamp {
    at: Instant,
    lazily: bool,
    due: bool,
}

impl Stamp {
    pub(super) fn new(lazily: bool) -> Stamp {
        Stamp {
            at: Instant::now(),
            lazily,
            due: false,
        }
    }

    /// An activity now.
    pub(super) fn touch(&mut self) {
        if self.lazily {
            self.due = true;
        } else {
            self.at = Instant::now();
        }
    }

    /// How long since the last activity, at `now` (stamping one not stamped yet with `now`).
    pub(super) fn quiet(&mut self, now: Instant) -> Duration {
        if std::mem::take(&mut self.due) {
            self.at = now;
        }
        now.saturating_duration_since(self.at)
    }
}

/// The progress state of one endpoint (see the module docs).
pub(super) struct Progress {
    pub(super) core: Arc<Mutex<Core>>,
    pub(super) config: EndpointConfig,
    /// The CQ has a wait fd (the actor sleeps on it past a spin).
    pub(super) wait_fd: bool,
    /// When ops last moved (a completion, a post).
    pub(super) last_activity: Stamp,
    pub(super) metrics: EndpointMetrics,
    /// Progress passes (CQ reads) made: `FabricStats::polls`.
    pub(super) polls: u64,
    /// `Core::reader_passes` at the last pass or turn.
    pub(super) readers_seen: u64,
    /// The spin under way: a spin task runs while this is its number.
    pub(super) spin: Option<u64>,
    /// Spins started so far (the next one's number).
    pub(super) spins: u64,
    /// The spin task's waker while it sleeps between spins.
    pub(super) spinner: Option<Waker>,
    /// The actor has stopped: the spin task ends.
    pub(super) closed: bool,
}

impl Progress {
    /// Starts a spin (the spin task takes it up at its next turn, woken if it sleeps).
    pub(super) fn start_spin(&mut self) {
        self.spins += 1;
        self.spin = Some(self.spins);
        if let Some(w) = self.spinner.take() {
            w.wake();
        }
    }

    /// Ends the spin task (the actor has stopped), and publishes the endpoint's last counters,
    /// taking its backlog out of the gauge.
    pub(super) fn close(&mut self) {
        let stats = lock(&self.core).engine.stats();
        self.metrics.publish(stats);
        self.metrics.close();
        self.spin = None;
        self.closed = true;
        if let Some(w) = self.spinner.take() {
            w.wake();
        }
    }

    /// Reads the CQ once (and retries the backlog) and hands out what ended; says whether
    /// anything did. Direct posts since the last look count as activity.
    pub(super) fn pass(&mut self) -> bool {
        self.pass_or_skip(false)
    }

    /// A spin task's turn: [`Progress::pass`], unless a stream reader has read the CQ since the
    /// last look (`Poster::spin_pass`): that pass stands for this one, and the turn only takes
    /// what the readers' passes handed out (activity) and the direct posts. While a reader
    /// waits in spin mode it reads the CQ on its own polls, so the spin task's reads were
    /// second passes, and one came between a reader handing a message to a recipient actor
    /// and that actor's turn (on `tcp;ofi_rxm` a pass costs microseconds: its sockets are read).
    /// The CQ is still read on every turn that follows no reader's pass (a reader busy
    /// copying a large message makes none). Measured in git history's docs/efa-measurements.md, "A recipient
    /// actor's turn without a pass before it" (64 MiB level in spin mode, against 6-8 %
    /// slower on `shm` in one call of three when the readers made one pass a poll: "A reader
    /// that reads the CQ itself").
    pub(super) fn turn(&mut self) -> bool {
        self.pass_or_skip(true)
    }

    fn pass_or_skip(&mut self, skip_after_readers: bool) -> bool {
        let mut c = lock(&self.core);
        let readers_passed = c.reader_passes != self.readers_seen;
        self.readers_seen = c.reader_passes;
        // What stream readers' own passes handed out since the last look counts as activity
        // (those passes have forgotten the pipes they finished, as any pass does).
        let found = std::mem::take(&mut c.reader_found);
        // A pass retries the backlog: it may shrink it without any completion.
        let backlogged = c.engine.backlogged();
        let (r, delivered) = if skip_after_readers && readers_passed {
            (Ok(0), false)
        } else {
            self.polls += 1;
            c.progress()
        };
        let any = found || delivered;
        let posted = std::mem::take(&mut c.posted);
        // Counters move only with posts, completions and retries of the backlog (a spin's
        // empty passes publish nothing: building the engine's `Stats` is most of what
        // publishing costs). So the backlog gauge follows every pass that changes the backlog:
        // a post refused, a retry taken, found at the next pass whoever posted.
        if any || posted || backlogged || c.engine.backlogged() || !matches!(r, Ok(0)) {
            self.metrics.publish(c.engine.stats());
        }
        drop(c);
        match r {
            Ok(n) if n > 0 || any => self.activity(),
            Ok(_) if posted => self.activity(),
            Ok(_) => {}
            Err(e) => tracing::warn!("{e}: every pipe on this endpoint failed"),
        }
        any
    }

    /// Ops moved (a completion, a post): the spin window starts again, and polls past it back
    /// off from `min_sleep` again.
    pub(super) fn activity(&mut self) {
        self.last_activity.touch();
    }

    /// How long after the last completion or post the endpoint keeps reading the CQ on every
    /// turn of its thread: `busy_poll` where it could sleep on the wait fd; where it polls
    /// anyway (no wait fd, or ops backlogged), at least `spin`.
    pub(super) fn spin_window(&self, backlogged: bool) -> Duration {
        if self.wait_fd && !backlogged {
            self.config.busy_poll
        } else {
            self.config.busy_poll.max(self.config.spin)
        }
    }

    /// Whether ops are posted or backlogged.
    pub(super) fn busy(&self) -> bool {
        lock(&self.core).engine.busy()
    }

    /// Whether a spin is due at `now`: ops in flight, and the last activity within the spin
    /// window.
    pub(super) fn spin_due_at(&mut self, now: Instant) -> bool {
        let c = lock(&self.core);
        let window = self.spin_window(c.engine.backlogged());
        c.engine.busy() && self.last_activity.quiet(now) < window
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn polls_past_the_window_sleep_an_eighth_of_the_quiet_within_bounds() {
        let c = EndpointConfig {
            min_sleep: Duration::from_micros(25),
            max_sleep: Duration::from_millis(1),
            ..EndpointConfig::default()
        };
        let us = Duration::from_micros;
        // Just past the default 200 µs window: the shortest sleep.
        assert_eq!(poll_sleep(&c, us(200)), us(25));
        assert_eq!(poll_sleep(&c, us(0)), us(25));
        // A quiet of 2 ms: a message landing now is read within 250 µs, not 1 ms.
        assert_eq!(poll_sleep(&c, us(2_000)), us(250));
        // Steady idleness: `max_sleep`, the idle cost of before.
        assert_eq!(poll_sleep(&c, us(8_000)), us(1_000));
        assert_eq!(poll_sleep(&c, Duration::from_secs(60)), us(1_000));
        // A zero `min_sleep` still sleeps (no poll on every turn for ever), and a `max_sleep`
        // below `min_sleep` gives way to it.
        let odd = EndpointConfig {
            min_sleep: Duration::ZERO,
            max_sleep: Duration::ZERO,
            ..c
        };
        assert_eq!(poll_sleep(&odd, Duration::ZERO), us(1));
        assert_eq!(poll_sleep(&odd, Duration::from_secs(1)), us(1));
    }
}
