//! Large copies shared among a few threads of the process.
//!
//! One thread copies 64 MiB at 6–8 GB/s on the 16-core machine of git history's docs/performance-many-cores.md ("Large
//! copies shared among copy threads"), where four threads copy 48 GB/s and eight 82 GB/s
//! (`actorpipe bench copy`): a large copy made by one thread leaves most of the memory system
//! idle, and holds its thread (a context's arbiter, with every pipe on it) for the whole copy.
//! [`copy_spans`] cuts a copy of at least [`SHARED_MIN`] bytes into shares of at least 64 KiB
//! and copies them on the calling thread and on the process's **copy threads** at once.
//!
//! - **Who copies.** The caller posts the job, copies shares itself, and then waits only for the
//!   shares a copy thread had already taken: a share is claimed with one atomic increment, by
//!   whoever comes first. A busy pool (several callers at once) or a slow wake-up therefore
//!   costs a caller nothing beyond copying its shares alone, as it would without the pool.
//! - **The threads.** [`threads`] - 1 of them per process (the caller is the last), started on
//!   first use and kept for the life of the process (as a global pool is: none is created per
//!   copy). Idle, they sleep on a condition variable and cost nothing. A process forked from
//!   one whose copy threads had started has none (`fork` copies only the calling thread): its
//!   callers copy alone. The default is [`default_threads`] of the machine's cores: none on 2
//!   cores or fewer (a 2-core machine copies as before), a quarter of the cores above that, 2
//!   to 8. [`set_threads`] before the first large copy sets it, at most [`MAX_THREADS`]; 1 turns
//!   sharing off (`ACTORPIPE_COPY_THREADS=N` does it for contexts built by
//!   [`ContextBuilder::from_env`](crate::ContextBuilder::from_env), as they are built).
//! - **Order.** Every share is copied and, for non-temporal copies, fenced before the caller
//!   returns, and the caller reads the completion count with acquire ordering: whatever it
//!   stores afterwards (a ring's position, a completion) is seen after the bytes by any reader.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use super::pool::{Pool, Work};

/// Copies at least this long are shared out, where the process has copy threads.
pub const SHARED_MIN: usize = 256 << 10;

/// The smallest share: below it a share's hand-over costs more than its copy.
const SHARE_MIN: usize = 64 << 10;

/// Most spans one [`copy_spans`] call may take (a ring's wrap-around and a vectored write's
/// slices); more are copied by the caller alone.
pub const MAX_SPANS: usize = 8;

/// One contiguous piece of a copy: `len` bytes from `src` to `dst`.
#[derive(Debug, Clone, Copy)]
pub struct Span {
    /// Where the bytes are.
    pub src: *const u8,
    /// Where they go.
    pub dst: *mut u8,
    /// How many.
    pub len: usize,
}

/// Most threads a copy is shared among, whatever is asked for.
pub const MAX_THREADS: usize = 64;

/// The default number of threads a large copy is shared among, the caller included, on a
/// machine with `cores` CPUs: 1 (no sharing) on 2 cores or fewer, a quarter of the cores above
/// that, at least 2 and at most 8. Two processes copying at once (a ring's writer and reader)
/// then use half the machine at most.
pub fn default_threads(cores: usize) -> usize {
    if cores <= 2 {
        1
    } else {
        (cores / 4).clamp(2, 8)
    }
}

/// The count [`set_threads`] asked for; 0: not set.
static ASKED: AtomicUsize = AtomicUsize::new(0);
/// How many copy threads a copy may use (fixed at the first large copy).
static HELPERS: OnceLock<usize> = OnceLock::new();
/// The copy threads.
static POOL: Pool = Pool::new("actorpipe-copy");

/// Sets how many threads a large copy is shared among (the caller included, at most
/// [`MAX_THREADS`]; 1 turns sharing off), in place of the machine's default. Takes effect only
/// before the process's first large copy: returns the count in force when it comes too late.
pub fn set_threads(n: usize) -> Result<(), usize> {
    ASKED.store(n.max(1), Ordering::Relaxed);
    match HELPERS.get() {
        None => Ok(()),
        Some(h) => Err(h + 1),
    }
}

/// How many threads a large copy is shared among in this process, the caller included (1: the
/// caller alone). Fixes the count if no large copy has yet.
pub fn threads() -> usize {
    helpers() + 1
}

fn helpers() -> usize {
    *HELPERS.get_or_init(|| {
        let asked = match ASKED.load(Ordering::Relaxed) {
            0 => default_threads(std::thread::available_parallelism().map_or(1, |n| n.get())),
            n => n,
        };
        asked.clamp(1, MAX_THREADS) - 1
    })
}

/// Copies every span, sharing the work among the process's copy threads when the spans hold at
/// least [`SHARED_MIN`] bytes (see the module docs); `nt`: with non-temporal stores
/// ([`super::copy_nonoverlapping_nt`]).
///
/// # Safety
///
/// As `std::ptr::copy_nonoverlapping` for each span: `src` valid for reads and `dst` for
/// writes of `len` bytes, no destination overlapping any source or another destination, and
/// none of that memory written by anyone else until this returns.
pub unsafe fn copy_spans(spans: &[Span], nt: bool) {
    let total: usize = spans.iter().map(|s| s.len).sum();
    let helpers = if total >= SHARED_MIN && spans.len() <= MAX_SPANS {
        helpers()
    } else {
        0
    };
    if helpers > 0 {
        // SAFETY: the caller's guarantees, passed on.
        unsafe { copy_in(&POOL, helpers, spans, total, nt) }
    } else {
        for s in spans {
            // SAFETY: the caller's guarantees, passed on.
            unsafe { copy_one(s.src, s.dst, s.len, nt) };
        }
    }
}

/// Copies `len` bytes on this thread, with non-temporal stores when `nt`.
///
/// # Safety
///
/// As `std::ptr::copy_nonoverlapping(src, dst, len)`.
#[inline(always)]
pub(crate) unsafe fn copy_one(src: *const u8, dst: *mut u8, len: usize, nt: bool) {
    if nt {
        // SAFETY: the caller's guarantees, passed on.
        unsafe { super::copy_nonoverlapping_nt(src, dst, len) }
    } else {
        // SAFETY: the caller's guarantees, passed on.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
    }
}

/// One shared copy: its spans, cut into `shares` shares of `share` bytes (the last shorter),
/// each claimed by whoever increments `next` to its number first.
struct Job {
    spans: [Span; MAX_SPANS],
    count: usize,
    total: usize,
    share: usize,
    shares: usize,
    nt: bool,
    /// The next share to claim (may run past `shares`).
    next: AtomicUsize,
    /// Shares copied.
    done: AtomicUsize,
}

// SAFETY: a job's pointers are dereferenced only by whoever claimed a share (`next` below
// `shares`), and the caller of `copy_spans`, which guarantees the memory for its whole call,
// returns only once every share is copied (`done == shares`); a copy thread that takes the job
// later finds nothing to claim and touches no pointer.
unsafe impl Send for Job {}
// SAFETY: as above; the shared state is atomics.
unsafe impl Sync for Job {}

impl Work for Job {
    fn work(&self) -> usize {
        let mut copied = 0;
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.shares {
                return copied;
            }
            let from = i * self.share;
            let to = (from + self.share).min(self.total);
            // SAFETY: share `i` is ours alone (claimed above), inside the spans, which are
            // valid until `done` reaches `shares` (see `unsafe impl Send`).
            unsafe { self.copy_range(from, to) };
            self.done.fetch_add(1, Ordering::Release);
            copied += 1;
        }
    }
}

impl Job {
    /// Copies the bytes `from..to` of the spans laid end to end.
    ///
    /// # Safety
    ///
    /// The spans are valid (see [`copy_spans`]) and nobody else copies these bytes.
    unsafe fn copy_range(&self, from: usize, to: usize) {
        let mut base = 0;
        for s in &self.spans[..self.count] {
            let (lo, hi) = (from.max(base), to.min(base + s.len));
            if lo < hi {
                let off = lo - base;
                // SAFETY: `off + (hi - lo) <= s.len`: inside the span the caller vouches for.
                unsafe { copy_one(s.src.add(off), s.dst.add(off), hi - lo, self.nt) };
            }
            base += s.len;
            if base >= to {
                break;
            }
        }
    }
}

/// Copies `spans` (`total` bytes) with up to `wanted` of `pool`'s threads helping; see
/// [`copy_spans`].
///
/// # Safety
///
/// As [`copy_spans`].
unsafe fn copy_in(pool: &'static Pool, wanted: usize, spans: &[Span], total: usize, nt: bool) {
    let helpers = pool.helpers(wanted);
    let threads = helpers + 1;
    let shares = total.div_ceil(SHARE_MIN).clamp(1, 2 * threads);
    // Whole cache lines per share: no two threads write one line.
    let share = total.div_ceil(shares).next_multiple_of(64);
    let shares = total.div_ceil(share);
    let mut job = Job {
        spans: [Span {
            src: std::ptr::null(),
            dst: std::ptr::null_mut(),
            len: 0,
        }; MAX_SPANS],
        count: spans.len(),
        total,
        share,
        shares,
        nt,
        next: AtomicUsize::new(0),
        done: AtomicUsize::new(0),
    };
    job.spans[..spans.len()].copy_from_slice(spans);
    let job = Arc::new(job);
    let work: Arc<dyn Work> = job.clone();
    pool.offer(&work, (shares - 1).min(helpers));
    job.work();
    // What is left was claimed by copy threads, which are copying it now.
    let mut turns = 0u32;
    while job.done.load(Ordering::Acquire) < shares {
        turns = turns.wrapping_add(1);
        if turns % 4096 == 0 {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::pattern;
    use super::*;

    /// A pool of its own for each test (the process's one depends on the machine: none on 2
    /// cores), leaked as the process's is, with the number of threads a copy asks of it.
    fn pool_of(helpers: usize) -> (&'static Pool, usize) {
        (Box::leak(Box::new(Pool::new("test-copy"))), helpers)
    }

    /// Cuts `len` bytes at `cuts` into spans (src and dst offset alike).
    fn spans_of(src: &[u8], dst: &mut [u8], cuts: &[usize]) -> Vec<Span> {
        let mut at = 0;
        let mut out = Vec::new();
        for &end in cuts.iter().chain([&src.len()]) {
            out.push(Span {
                src: src[at..].as_ptr(),
                dst: dst[at..].as_mut_ptr(),
                len: end - at,
            });
            at = end;
        }
        out
    }

    #[test]
    fn shares_copy_exactly_what_memcpy_does() {
        let pool = pool_of(3);
        for len in [SHARED_MIN, SHARED_MIN + 1, (1 << 20) + 77, (8 << 20) + 3] {
            for nt in [false, true] {
                for cuts in [
                    vec![],
                    vec![1],
                    vec![4095, len / 2, len - 64],
                    vec![len / 3],
                ] {
                    let src = pattern(len + 7, len as u8);
                    let src = &src[7..];
                    let mut all = vec![0xA5u8; len + 130];
                    let dst = &mut all[65..65 + len];
                    let spans = spans_of(src, dst, &cuts);
                    // SAFETY: the spans cut `src` and `dst`, which outlive the call.
                    unsafe { copy_in(pool.0, pool.1, &spans, len, nt) };
                    assert!(all[65..65 + len] == *src, "len {len} nt {nt} cuts {cuts:?}");
                    assert!(all[..65].iter().all(|&b| b == 0xA5));
                    assert!(all[65 + len..].iter().all(|&b| b == 0xA5));
                }
            }
        }
    }

    #[test]
    fn copy_threads_take_shares() {
        let pool = pool_of(2);
        let src = pattern(4 << 20, 9);
        let mut dst = vec![0u8; 4 << 20];
        // A copy thread that the scheduler has not run yet leaves every share to the caller,
        // so keep copying until one helps: 50 copies were not always enough on 64 cores
        // running a dozen test suites at once (2026-11-28). The bound is only there to end a
        // run whose copy threads never take a share.
        let (mut copies, started) = (0, std::time::Instant::now());
        while pool.0.helped() == 0 && started.elapsed() < std::time::Duration::from_secs(20) {
            let spans = spans_of(&src, &mut dst, &[]);
            // SAFETY: as above.
            unsafe { copy_in(pool.0, pool.1, &spans, src.len(), false) };
            copies += 1;
        }
        assert_eq!(dst, src);
        assert!(
            pool.0.helped() > 0,
            "no share was copied by a copy thread in {copies} copies of 4 MiB (20 s)"
        );
    }

    #[test]
    fn callers_at_once_share_one_pool() {
        let pool = pool_of(1);
        std::thread::scope(|s| {
            for t in 0..4u8 {
                s.spawn(move || {
                    for k in 0..20u8 {
                        let src = pattern((1 << 20) + k as usize * 4099, t ^ k);
                        let mut dst = vec![0u8; src.len()];
                        let spans = spans_of(&src, &mut dst, &[src.len() / 2 + 1]);
                        // SAFETY: as above.
                        unsafe { copy_in(pool.0, pool.1, &spans, src.len(), k % 2 == 0) };
                        assert!(dst == src, "caller {t} copy {k}");
                    }
                });
            }
        });
    }

    #[test]
    fn copies_of_many_spans_or_few_bytes_are_exact() {
        let src = pattern(SHARED_MIN + 100, 3);
        let mut dst = vec![0u8; src.len()];
        let cuts: Vec<usize> = (1..=MAX_SPANS).map(|i| i * 1000).collect();
        let spans = spans_of(&src, &mut dst, &cuts);
        assert!(spans.len() > MAX_SPANS);
        // SAFETY: as above.
        unsafe { copy_spans(&spans, true) };
        assert!(dst == src);
        let mut small = vec![0u8; 1000];
        let spans = spans_of(&src[..1000], &mut small, &[10]);
        // SAFETY: as above.
        unsafe { copy_spans(&spans, false) };
        assert!(small[..] == src[..1000]);
    }

    /// A child forked after the copy threads started has none of them: its copies are the
    /// caller's alone, whole and correct, and queue no job that no thread would ever take.
    #[test]
    fn a_forked_child_copies_alone() {
        let pool = pool_of(2);
        let src = pattern(2 << 20, 5);
        let mut dst = vec![0u8; src.len()];
        let spans = spans_of(&src, &mut dst, &[]);
        // SAFETY: as above.
        unsafe { copy_in(pool.0, pool.1, &spans, src.len(), false) };
        assert!(dst == src);
        super::super::check_in_forked_child(pool.0, || {
            let mut dst = vec![0u8; src.len()];
            let spans = spans_of(&src, &mut dst, &[1000]);
            // SAFETY: as above.
            unsafe { copy_in(pool.0, pool.1, &spans, src.len(), true) };
            dst == src
        });
    }

    #[test]
    fn default_threads_follow_the_machine() {
        assert_eq!(default_threads(1), 1);
        assert_eq!(default_threads(2), 1);
        assert_eq!(default_threads(4), 2);
        assert_eq!(default_threads(16), 4);
        assert_eq!(default_threads(192), 8);
    }
}
