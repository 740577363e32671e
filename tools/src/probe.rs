//! How fast two cores of this machine reach each other, measured in a few tens of milliseconds
//! at the start and at the end of a run and printed with its table.
//!
//! Same-host results depend on it more than on anything actorpipe does: on the 2-core VM the
//! project's figures come from, the host sometimes places the two virtual CPUs where a cache
//! line takes 0.3 µs to go there and back, and sometimes where it takes over 1 µs and a 1 MiB
//! hand-over runs at a third of the speed. A run that straddles such a change shows it here.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// What the probe saw.
#[derive(Debug, Clone, Copy)]
pub struct CrossCore {
    /// The two CPUs.
    pub cpus: (usize, usize),
    /// Median time for a cache line to go to the other core and back.
    pub line_round_trip: Duration,
    /// Median rate at which one core copies out 1 MiB the other one has just written.
    pub handover_gbps: f64,
}

impl CrossCore {
    /// One line of text.
    pub fn describe(&self) -> String {
        format!(
            "CPUs {}↔{}: cache line there and back {:.2} µs; 1 MiB written on one, copied on the other at {:.1} GB/s",
            self.cpus.0,
            self.cpus.1,
            self.line_round_trip.as_secs_f64() * 1e6,
            self.handover_gbps
        )
    }
}

const ROUND_TRIPS: usize = 5_000;
const HANDOVERS: usize = 31;
const SIZE: usize = 1 << 20;
/// The probe gives up (reporting nothing) if the other thread stops answering this long.
const PATIENCE: Duration = Duration::from_secs(2);

#[repr(align(128))]
struct Line(AtomicU64);

/// A buffer written by one thread and read by the other, turn by turn (the turns are ordered
/// by `Line`'s acquire/release handshakes).
struct Shared(std::cell::UnsafeCell<Vec<u8>>);
// SAFETY: the two threads touch the buffer only in turns separated by release/acquire pairs.
unsafe impl Sync for Shared {}

/// The calling thread's CPU set.
fn affinity() -> Option<libc::cpu_set_t> {
    // SAFETY: a zeroed cpu_set_t is valid; sched_getaffinity fills it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        (libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) == 0)
            .then_some(set)
    }
}

/// The first two CPUs of the calling thread's set or, if it holds one only (`--pin` pins the
/// whole process), the first two online CPUs.
fn two_cpus() -> Option<(usize, usize)> {
    let set = affinity()?;
    // SAFETY: CPU_ISSET reads the set.
    let mut mine = (0..libc::CPU_SETSIZE as usize).filter(|&c| unsafe { libc::CPU_ISSET(c, &set) });
    if let (Some(a), Some(b)) = (mine.next(), mine.next()) {
        return Some((a, b));
    }
    // SAFETY: sysconf reads a system setting.
    let online = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    (online >= 2).then_some((0, 1))
}

fn pin(cpu: usize) -> bool {
    // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET and sched_setaffinity only touch it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    }
}

/// Waits until `line` holds `want`; false if that takes longer than [`PATIENCE`] or the other
/// side gave up.
fn wait_for(line: &Line, want: u64, gave_up: &AtomicBool) -> bool {
    let start = Instant::now();
    let mut spins = 0u32;
    while line.0.load(Ordering::Acquire) != want {
        std::hint::spin_loop();
        spins = spins.wrapping_add(1);
        if spins % 4096 == 0 && (gave_up.load(Ordering::Relaxed) || start.elapsed() > PATIENCE) {
            gave_up.store(true, Ordering::Relaxed);
            return false;
        }
    }
    true
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort_unstable();
    v[v.len() / 2]
}

/// Measures; `None` where fewer than two CPUs are available or a thread cannot be pinned.
pub fn measure() -> Option<CrossCore> {
    let cpus = two_cpus()?;
    let before = affinity()?;
    let line = Arc::new(Line(AtomicU64::new(0)));
    let gave_up = Arc::new(AtomicBool::new(false));
    let buffer = Arc::new(Shared(std::cell::UnsafeCell::new(vec![0u8; SIZE])));
    let ready = Arc::new(Barrier::new(2));
    let other = {
        let (line, gave_up, buffer, ready) =
            (line.clone(), gave_up.clone(), buffer.clone(), ready.clone());
        std::thread::Builder::new()
            .name("probe".into())
            .spawn(move || -> Option<Vec<Duration>> {
                let pinned = pin(cpus.1);
                ready.wait();
                if !pinned {
                    gave_up.store(true, Ordering::Relaxed);
                    return None;
                }
                // Ping-pong: answer each odd value with the next even one.
                for i in 0..ROUND_TRIPS as u64 {
                    if !wait_for(&line, 2 * i + 1, &gave_up) {
                        return None;
                    }
                    line.0.store(2 * i + 2, Ordering::Release);
                }
                // Hand-overs: copy out what the other core wrote, then hand the turn back.
                let mut mine = vec![0u8; SIZE];
                let mut took = Vec::with_capacity(HANDOVERS);
                let base = 2 * ROUND_TRIPS as u64;
                for i in 0..HANDOVERS as u64 {
                    if !wait_for(&line, base + 2 * i + 1, &gave_up) {
                        return None;
                    }
                    let t = Instant::now();
                    // SAFETY: the writer handed the buffer over (release/acquire on `line`)
                    // and does not touch it until we hand it back below.
                    mine.copy_from_slice(unsafe { &*buffer.0.get() });
                    took.push(t.elapsed());
                    std::hint::black_box(&mine);
                    line.0.store(base + 2 * i + 2, Ordering::Release);
                }
                Some(took)
            })
            .ok()?
    };
    let pinned = pin(cpus.0);
    ready.wait();
    let mut trips = Vec::with_capacity(ROUND_TRIPS / 100);
    let mut ok = pinned;
    if ok {
        let mut t = Instant::now();
        for i in 0..ROUND_TRIPS as u64 {
            line.0.store(2 * i + 1, Ordering::Release);
            if !wait_for(&line, 2 * i + 2, &gave_up) {
                ok = false;
                break;
            }
            // Time batches of 100 so that reading the clock stays off the measurement.
            if i % 100 == 99 {
                trips.push(t.elapsed() / 100);
                t = Instant::now();
            }
        }
    }
    let base = 2 * ROUND_TRIPS as u64;
    for i in 0..HANDOVERS as u64 {
        if !ok {
            break;
        }
        // SAFETY: the reader hands the buffer back before we write it again.
        unsafe { (*buffer.0.get()).fill(i as u8) };
        line.0.store(base + 2 * i + 1, Ordering::Release);
        ok = wait_for(&line, base + 2 * i + 2, &gave_up);
    }
    if !ok {
        gave_up.store(true, Ordering::Relaxed);
    }
    let took = other.join().ok().flatten();
    // The probe ran on the calling thread: give it back its own CPUs.
    // SAFETY: `before` is a set read by sched_getaffinity.
    unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &before) };
    let took = took.filter(|_| ok)?;
    let handover = median(took);
    Some(CrossCore {
        cpus,
        line_round_trip: median(trips),
        handover_gbps: SIZE as f64 / handover.as_secs_f64() / 1e9,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_measures_or_says_why_not() {
        match measure() {
            Some(c) => {
                assert_ne!(c.cpus.0, c.cpus.1);
                assert!(c.line_round_trip > Duration::ZERO);
                assert!(c.handover_gbps.is_finite() && c.handover_gbps > 0.0);
                assert!(c.describe().contains("GB/s"));
            }
            None => assert!(two_cpus().is_none(), "two CPUs, yet no measurement"),
        }
    }
}
