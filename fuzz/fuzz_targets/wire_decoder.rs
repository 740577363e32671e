//! Fuzzes the wire decoder with arbitrary bytes, read two ways:
//!
//! - as one frame's bytes after its length prefix: the length check, then `decode_frame`;
//! - as a byte stream: `read_frame` over an in-memory reader, frame after frame until it fails;
//!
//! each under the default limits and under tight ones. Nothing may panic, and no single
//! allocation made while decoding may exceed the limits' `max_frame_size` plus [`SLACK`], plus,
//! for the handshake frames that serde decodes, what serde may reserve for a sequence whose
//! count fits in the frame (`SERDE_RESERVE_PER_BYTE` per byte of input, at each of the few
//! nesting levels): a counting global allocator records the largest block requested, and the
//! target asserts on it after each call (an allocator must not panic itself).

#![no_main]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::OnceLock;

use actorpipe::internal::fuzz::{wire_frame, wire_limits, wire_stream};
use actorpipe::internal::wire::{Limits, SERDE_RESERVE_PER_BYTE};
use libfuzzer_sys::fuzz_target;

/// What decoding may allocate beyond the frame size (error messages, small vectors).
const SLACK: usize = 4096;
/// Nesting levels of the handshake frames at which a sequence may be reserved at once.
const SERDE_LEVELS: usize = 4;

static MEASURING: AtomicBool = AtomicBool::new(false);
static LARGEST: AtomicUsize = AtomicUsize::new(0);
static TOTAL: AtomicUsize = AtomicUsize::new(0);

struct Counting;

impl Counting {
    fn note(size: usize) {
        if MEASURING.load(Ordering::Relaxed) {
            LARGEST.fetch_max(size, Ordering::Relaxed);
            TOTAL.fetch_add(size, Ordering::Relaxed);
        }
    }
}

// SAFETY: every call is forwarded unchanged to the system allocator; we only count.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        Self::note(layout.size());
        System.alloc(layout)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        Self::note(layout.size());
        System.alloc_zeroed(layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        Self::note(new_size);
        System.realloc(ptr, layout, new_size)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Everything built once, outside any measurement.
struct Setup {
    runtime: tokio::runtime::Runtime,
    limit_sets: [Limits; 2],
}

fn setup() -> &'static Setup {
    static SETUP: OnceLock<Setup> = OnceLock::new();
    SETUP.get_or_init(|| Setup {
        runtime: tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a current-thread runtime"),
        limit_sets: wire_limits(),
    })
}

/// Runs `f`, then asserts that no block it requested exceeded `bound`.
fn within<T>(what: &str, limits: &Limits, bound: usize, f: impl FnOnce() -> T) -> T {
    LARGEST.store(0, Ordering::Relaxed);
    TOTAL.store(0, Ordering::Relaxed);
    MEASURING.store(true, Ordering::Relaxed);
    let out = f();
    MEASURING.store(false, Ordering::Relaxed);
    let largest = LARGEST.load(Ordering::Relaxed);
    assert!(
        largest <= bound,
        "{what} under {limits:?} requested a block of {largest} bytes (bound {bound}, {} in all)",
        TOTAL.load(Ordering::Relaxed),
    );
    out
}

fuzz_target!(|data: &[u8]| {
    let s = setup();
    for limits in &s.limit_sets {
        let serde = SERDE_LEVELS * SERDE_RESERVE_PER_BYTE * data.len();
        let bound = limits.max_frame_size as usize + SLACK + serde;

        // One frame: its announced length is the input's length (saturated: a longer input
        // is over any u32 limit anyway).
        within("decode_frame", limits, bound, || wire_frame(data, limits));
        // A stream: frames until the bytes run out or one is refused.
        within("read_frame", limits, bound, || {
            s.runtime.block_on(wire_stream(data, limits))
        });
    }
});
