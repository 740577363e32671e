//! What a measurement is made of: how many round trips, their times, and their percentiles.

use std::time::Duration;

/// Round-trip times of one size, in the order they were taken (warm-up excluded).
pub type Samples = Vec<Duration>;

/// How many round trips to run for one size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    /// Untimed round trips first: buffers allocated and faulted in, caches and sockets warm.
    pub warmup: u32,
    /// Timed round trips.
    pub iters: u32,
}

impl Counts {
    /// The counts for `size` bytes: `iters` and `warmup` when given, otherwise about 256 MiB of
    /// traffic each way (between 20 and 10 000 round trips) after a tenth as many to warm up.
    pub fn for_size(size: u64, iters: Option<u32>, warmup: Option<u32>) -> Counts {
        let iters =
            iters.unwrap_or_else(|| ((256u64 << 20) / size.max(1)).clamp(20, 10_000) as u32);
        let warmup = warmup.unwrap_or((iters / 10).max(2));
        Counts { warmup, iters }
    }

    /// Round trips in all.
    pub fn total(&self) -> u32 {
        self.warmup + self.iters
    }
}

/// The percentiles a table shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Summary {
    /// Timed round trips.
    pub count: usize,
    /// Median round trip.
    pub p50: Duration,
    /// 99th percentile round trip (the slowest one when there are fewer than 100).
    pub p99: Duration,
}

impl Summary {
    /// Nearest-rank percentiles of `samples`; `None` when there are none.
    pub fn of(samples: &[Duration]) -> Option<Summary> {
        if samples.is_empty() {
            return None;
        }
        let mut sorted = samples.to_vec();
        sorted.sort_unstable();
        let rank = |p: usize| sorted[(sorted.len() * p).div_ceil(100).max(1) - 1];
        Some(Summary {
            count: sorted.len(),
            p50: rank(50),
            p99: rank(99),
        })
    }
}

/// Deterministic bytes (xorshift64), so that an echo can be checked.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut out = vec![0u8; len];
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut words = out.chunks_exact_mut(8);
    for w in &mut words {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        w.copy_from_slice(&x.to_le_bytes());
    }
    for b in words.into_remainder() {
        x ^= x << 13;
        *b = x as u8;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_use_nearest_rank() {
        let ms = |n| Duration::from_millis(n);
        let s = Summary::of(&(1..=100).rev().map(ms).collect::<Vec<_>>()).unwrap();
        assert_eq!((s.p50, s.p99, s.count), (ms(50), ms(99), 100));
        let s = Summary::of(&[ms(3), ms(1), ms(2)]).unwrap();
        assert_eq!((s.p50, s.p99), (ms(2), ms(3)));
        assert!(Summary::of(&[]).is_none());
    }

    #[test]
    fn default_counts_scale_with_size() {
        assert_eq!(Counts::for_size(64, None, None).iters, 10_000);
        assert_eq!(Counts::for_size(1 << 20, None, None).iters, 256);
        assert_eq!(
            Counts::for_size(64 << 20, None, None),
            Counts {
                warmup: 2,
                iters: 20
            }
        );
        assert_eq!(
            Counts::for_size(64, Some(5), Some(0)),
            Counts {
                warmup: 0,
                iters: 5
            }
        );
    }
}
