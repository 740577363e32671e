//! Large copies with non-temporal stores.
//!
//! glibc's `memcpy` (2.36) writes through the cache until a copy is larger than
//! `x86_non_temporal_threshold`, which is three quarters of the L3 (192 MiB on the machine in
//! docs/performance.md). Below that, a copy whose destination does not fit in the cache pays for
//! reading every destination line before overwriting it, and runs at about half the speed the
//! memory allows. [`copy_large`] streams the destination with non-temporal stores instead, when
//! the copy is at least [`NT_MIN`] bytes and the CPU has SSE2 (every x86_64 does); otherwise,
//! and on other architectures, it is `copy_from_slice`.
//!
//! Use it only where the destination will not be read again soon from the cache: non-temporal
//! stores go around it, so a reader that follows at once reads from memory.
//!
//! A copy of at least [`SHARED_MIN`] bytes is shared among the process's copy threads
//! ([`copy_spans`], module `shared`): the xth channel's copies ([`copy_large`]) and the shm
//! ring's large reads and writes.

mod pool;
mod shared;

pub(crate) use pool::check_in_forked_child;
pub(crate) use pool::{Pool, Work};
pub(crate) use shared::copy_one;
pub use shared::{
    copy_spans, default_threads, set_threads, threads, Span, MAX_SPANS, MAX_THREADS, SHARED_MIN,
};

/// Copies at least this long go through non-temporal stores. Smaller ones fit comfortably in the
/// L3 cache, where the next reader (the echo, the application) finds them.
pub const NT_MIN: usize = 8 << 20;

/// Copies `src` into `dst` (the same length), with non-temporal stores when the copy is at least
/// [`NT_MIN`] bytes, shared among the process's copy threads from [`SHARED_MIN`] bytes.
///
/// # Panics
///
/// If the lengths differ, as `copy_from_slice` does.
pub fn copy_large(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_large: lengths differ");
    if dst.len() >= SHARED_MIN {
        let span = Span {
            src: src.as_ptr(),
            dst: dst.as_mut_ptr(),
            len: dst.len(),
        };
        // SAFETY: both slices are `len` bytes, a `&mut` cannot overlap a `&`, and both borrows
        // last for the call.
        unsafe { copy_spans(&[span], dst.len() >= NT_MIN) };
    } else {
        dst.copy_from_slice(src);
    }
}

/// Copies `src` into `dst` (the same length) with non-temporal stores for the aligned middle of
/// the destination, whatever the length; plain copies for the unaligned ends. Ends with a store
/// fence, so the bytes are visible to other cores (and processes) in order with later stores.
///
/// # Panics
///
/// If the lengths differ.
pub fn copy_nt(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_nt: lengths differ");
    // SAFETY: both slices are `len` bytes, and a `&mut` cannot overlap a `&`.
    unsafe { copy_nonoverlapping_nt(src.as_ptr(), dst.as_mut_ptr(), dst.len()) }
}

/// [`copy_nt`] on raw pointers, for memory that cannot be a slice (uninitialized destination
/// bytes, a mapping another process writes to).
///
/// # Safety
///
/// As [`std::ptr::copy_nonoverlapping`]: `src` valid for reads and `dst` for writes of `len`
/// bytes, and the two ranges do not overlap.
pub unsafe fn copy_nonoverlapping_nt(src: *const u8, dst: *mut u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: the caller's guarantees, passed on.
        unsafe { x86::copy_nt_sse2(src, dst, len) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        // SAFETY: the caller's guarantees, passed on.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};

    /// Bytes per loop iteration: four 16-byte stores, one cache line.
    const BLOCK: usize = 64;

    /// # Safety
    ///
    /// As `std::ptr::copy_nonoverlapping(src, dst, len)`.
    pub(super) unsafe fn copy_nt_sse2(src: *const u8, dst: *mut u8, len: usize) {
        // Plain copy up to the first 16-byte boundary of the destination.
        let head = dst.align_offset(16).min(len);
        let body = (len - head) / BLOCK * BLOCK;
        // SAFETY (whole block): every offset used below is below `head + body + (len - head -
        // body) = len`, inside both ranges the caller vouches for, and they do not overlap. SSE2
        // is part of the x86_64 baseline. Loads are unaligned loads; each store address is
        // `dst + head + 16 k`, a multiple of 16 as `_mm_stream_si128` requires.
        unsafe {
            std::ptr::copy_nonoverlapping(src, dst, head);
            let (mut s, mut d) = (src.add(head), dst.add(head));
            let end = d.add(body);
            while d < end {
                let sp = s.cast::<__m128i>();
                let dp = d.cast::<__m128i>();
                let a = _mm_loadu_si128(sp);
                let b = _mm_loadu_si128(sp.add(1));
                let c = _mm_loadu_si128(sp.add(2));
                let e = _mm_loadu_si128(sp.add(3));
                _mm_stream_si128(dp, a);
                _mm_stream_si128(dp.add(1), b);
                _mm_stream_si128(dp.add(2), c);
                _mm_stream_si128(dp.add(3), e);
                s = s.add(BLOCK);
                d = d.add(BLOCK);
            }
            // Non-temporal stores are weakly ordered: the fence orders them before whatever we
            // store next (a ring's tail, a completion), so a reader that sees that sees the bytes.
            _mm_sfence();
            let tail = head + body;
            std::ptr::copy_nonoverlapping(src.add(tail), dst.add(tail), len - tail);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Bytes that differ from their neighbours and from one seed to the next (the shared
    /// copies' tests use it too).
    pub(super) fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8)
            .collect()
    }

    /// Every destination and source alignment within a cache line, and lengths around the block
    /// size and its multiples; the bytes around the destination stay untouched.
    #[test]
    fn every_alignment_and_short_length() {
        let src_all = pattern(600, 7);
        for len in (0..=200).chain([255, 256, 257, 511, 512, 513]) {
            for d_off in 0..64 {
                for s_off in [0, 1, 3, 8, 15, 16, 33, 63] {
                    let mut dst_all = vec![0xAAu8; len + 128];
                    let src = &src_all[s_off..s_off + len];
                    copy_nt(&mut dst_all[d_off..d_off + len], src);
                    assert_eq!(
                        &dst_all[d_off..d_off + len],
                        src,
                        "len {len} d {d_off} s {s_off}"
                    );
                    assert!(dst_all[..d_off].iter().all(|&b| b == 0xAA));
                    assert!(dst_all[d_off + len..].iter().all(|&b| b == 0xAA));
                }
            }
        }
    }

    #[test]
    fn large_copies_take_the_streaming_path() {
        for len in [NT_MIN - 1, NT_MIN, NT_MIN + 77] {
            let src = pattern(len + 5, 3);
            let mut dst = vec![0u8; len + 9];
            copy_large(&mut dst[9..], &src[5..]);
            assert_eq!(&dst[9..], &src[5..]);
            assert!(dst[..9].iter().all(|&b| b == 0));
        }
    }

    #[test]
    #[should_panic(expected = "lengths differ")]
    fn lengths_must_match() {
        copy_large(&mut [0u8; 3], &[1u8; 4]);
    }

    proptest! {
        #[test]
        fn copies_exactly_what_memcpy_does(
            len in 0usize..5000,
            d_off in 0usize..64,
            s_off in 0usize..64,
            seed in any::<u8>(),
        ) {
            let src_all = pattern(len + 64, seed);
            let src = &src_all[s_off..s_off + len];
            let mut ours = vec![0x55u8; len + 64];
            let mut theirs = ours.clone();
            copy_nt(&mut ours[d_off..d_off + len], src);
            theirs[d_off..d_off + len].copy_from_slice(src);
            prop_assert_eq!(ours, theirs);
        }
    }
}
