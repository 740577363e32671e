//! Benchmarks of the hot paths that need no network: wire encoding and decoding, negotiation,
//! the shm ring's copies, and chunk planning.
//!
//! `cargo bench --bench hot_paths` runs them all; add `-- --quick` for a fast look, or a filter
//! (`-- wire/`) for one group. Before measuring, an allocation audit prints how many heap
//! allocations one call of each path makes: the encoders, the ring and the planners are meant to
//! allocate nothing once warm, so a number above zero there is a regression.

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::io::IoSlice;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

use actorpipe::internal::backend::{basic, cma, mpt};
use actorpipe::internal::negotiate::{self, Brochure, ChannelOffer, DevicePair, Offer};
use actorpipe::internal::transport::stream::Sequencer;
use actorpipe::internal::wire::{self, ChunkHeader, FrameKind, Limits};
use actorpipe::{Device, Message, Payload, Tensor};

// ---------------------------------------------------------------------------------------------
// Wire: descriptor and chunk header frames.

/// A message of `n` payloads and `n` tensors with small metadata, as a training step sends
/// (the buffers' contents never reach the descriptor, only their lengths).
fn message(n: usize) -> Message {
    let mut m = Message::new().with_metadata(b"step=1234;rank=3".to_vec());
    for i in 0..n {
        m = m.with_payload(Payload {
            data: vec![0; 256],
            metadata: format!("p{i:02}").into_bytes(),
        });
        let mut t = Tensor::cpu(vec![0; 4096]);
        t.metadata = format!("layer.{i:02}.weight:f32[32,32]").into_bytes();
        t.target_device = (i % 2 == 1).then_some(Device::Cpu);
        m = m.with_tensor(t);
    }
    m
}

fn encode_descriptor(buf: &mut Vec<u8>, seq: u64, msg: &Message) {
    buf.clear();
    wire::encode_frame(buf, FrameKind::Descriptor, |b| {
        wire::encode_descriptor(b, seq, msg, |_, _| 0)
    });
}

const CHUNK: ChunkHeader = ChunkHeader {
    seq: 1 << 20,
    tensor: 7,
    offset: 3 << 30,
    length: 4 << 20,
};

fn encode_chunk(buf: &mut Vec<u8>, h: &ChunkHeader) {
    buf.clear();
    wire::encode_frame(buf, FrameKind::Chunk, |b| wire::encode_chunk(b, h));
}

fn bench_wire(c: &mut Criterion) {
    let limits = Limits::default();
    let mut g = c.benchmark_group("wire");
    for n in [1, 16] {
        let msg = message(n);
        let name = format!("{n}+{n}");
        let mut buf = Vec::new();
        g.bench_function(BenchmarkId::new("encode_descriptor", &name), |b| {
            b.iter(|| {
                encode_descriptor(&mut buf, black_box(42), black_box(&msg));
                black_box(buf.len())
            })
        });
        encode_descriptor(&mut buf, 42, &msg);
        g.bench_function(BenchmarkId::new("decode_descriptor", &name), |b| {
            b.iter(|| wire::decode_frame(black_box(&buf[wire::LEN_PREFIX..]), &limits).unwrap())
        });
    }
    let mut buf = Vec::new();
    g.bench_function("encode_chunk", |b| {
        b.iter(|| {
            encode_chunk(&mut buf, black_box(&CHUNK));
            black_box(buf.len())
        })
    });
    encode_chunk(&mut buf, &CHUNK);
    g.bench_function("decode_chunk", |b| {
        b.iter(|| wire::decode_frame(black_box(&buf[wire::LEN_PREFIX..]), &limits).unwrap())
    });
    g.finish();
}

// ---------------------------------------------------------------------------------------------
// Negotiation.

fn transport(name: &str, priority: i32, domain: &str, address: &str) -> Offer {
    Offer {
        name: name.into(),
        priority,
        domain: domain.into(),
        addresses: vec![address.into()],
    }
}

fn channel(name: &str, priority: i32, domain: &str, connections: u32) -> ChannelOffer {
    ChannelOffer {
        name: name.into(),
        priority,
        domain: domain.into(),
        devices: DevicePair::CPU,
        connections,
    }
}

/// What a default context offers on host `host` in process `pid`, with this build's default
/// priorities and domain strings shaped like the real ones.
fn brochure(host: &str, pid: u32) -> Brochure {
    let boot = format!("{host}-6f1c2d0e-8b7a-4e55-9d3f-0a1b2c3d4e5f");
    Brochure {
        transports: vec![
            transport("tcp", 0, "", &format!("tcp://{host}:5000")),
            transport(
                "shm",
                100,
                &format!("{boot}:4026531839:1000"),
                &format!("shm://{pid}-0"),
            ),
        ],
        channels: vec![
            channel("basic", 0, "", 0),
            channel("mpt", 10, "", 4),
            channel(
                "cma",
                200,
                &format!("boot={boot};pidns=4026531836;uid=1000:1000"),
                1,
            ),
            channel("xth", 300, &format!("{pid:016x}"), 0),
        ],
        remote: false,
    }
}

fn bench_negotiate(c: &mut Criterion) {
    let a = brochure("10.0.0.1", 4242);
    let same_host = brochure("10.0.0.1", 4343);
    let other_host = brochure("10.0.0.2", 4444);
    // Check once that the cases are the ones named.
    let choice = negotiate::choose(&a, &same_host).unwrap();
    assert_eq!(
        (choice.transport.as_str(), choice.channels[0].name.as_str()),
        ("shm", "cma")
    );
    let choice = negotiate::choose(&a, &other_host).unwrap();
    assert_eq!(
        (choice.transport.as_str(), choice.channels[0].name.as_str()),
        ("tcp", "mpt")
    );

    let mut g = c.benchmark_group("negotiate");
    g.bench_function("choose/same_host", |b| {
        b.iter(|| negotiate::choose(black_box(&a), black_box(&same_host)).unwrap())
    });
    g.bench_function("choose/other_host", |b| {
        b.iter(|| negotiate::choose(black_box(&a), black_box(&other_host)).unwrap())
    });
    g.finish();
}

// ---------------------------------------------------------------------------------------------
// The shm ring, both ends in one thread: the copy in and the copy out, nothing else.

#[cfg(target_os = "linux")]
fn bench_ring(c: &mut Criterion) {
    use actorpipe::internal::backend::shm::ring;

    let mut g = c.benchmark_group("ring");
    for size in [64usize, 4 << 10, 1 << 20] {
        let (mut p, mut r) = ring::in_memory(ring::DEFAULT_CAPACITY).unwrap();
        let src = vec![0x5au8; size];
        let mut dst = vec![0u8; size];
        g.throughput(Throughput::Bytes(size as u64));
        g.bench_function(BenchmarkId::new("write_read", label(size)), |b| {
            b.iter(|| {
                let n = p.write(&[IoSlice::new(black_box(&src))]).unwrap();
                let m = r.read(black_box(&mut dst)).unwrap();
                debug_assert_eq!((n, m), (size, size));
                black_box(m)
            })
        });
    }
    g.finish();
}

#[cfg(not(target_os = "linux"))]
fn bench_ring(_: &mut Criterion) {}

fn label(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 20 => format!("{}MiB", b >> 20),
        b if b >= 1 << 10 => format!("{}KiB", b >> 10),
        b => format!("{b}B"),
    }
}

// ---------------------------------------------------------------------------------------------
// Chunk planning and ordering.

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

fn basic_chunks() -> u64 {
    basic::chunks(black_box(64 * MIB), black_box(4 * MIB))
        .map(|(_, len)| len)
        .sum()
}

fn mpt_stripes() -> u64 {
    mpt::stripes(black_box(64 * MIB), black_box(4))
        .map(|(_, _, len)| len)
        .sum()
}

fn cma_plan() -> u64 {
    cma::plan(
        black_box(5 * GIB),
        black_box(cma::MAX_RW_COUNT_4K),
        black_box(8),
    )
    .flat_map(|share| share.pieces())
    .map(|(_, len)| len)
    .sum()
}

/// Tickets pushed per iteration of the sequencer benches.
const WINDOW: u64 = 8;

/// One window of tickets, pushed in order or reversed, then popped; the sequencer lives across
/// iterations, as a connection's does.
fn sequence(seq: &mut Sequencer<u64>, next: &mut u64, reversed: bool) -> u64 {
    let base = *next;
    for i in 0..WINDOW {
        let ticket = if reversed {
            base + WINDOW - 1 - i
        } else {
            base + i
        };
        seq.push(ticket, ticket).unwrap();
        if !reversed {
            black_box(seq.pop());
        }
    }
    if reversed {
        while let Some(t) = seq.pop() {
            black_box(t);
        }
    }
    *next += WINDOW;
    *next
}

fn bench_planning(c: &mut Criterion) {
    assert_eq!(basic_chunks(), 64 * MIB);
    assert_eq!(mpt_stripes(), 64 * MIB);
    assert_eq!(cma_plan(), 5 * GIB);

    let mut g = c.benchmark_group("planning");
    g.bench_function("basic_chunks/64MiB_by_4MiB", |b| b.iter(basic_chunks));
    g.bench_function("mpt_stripes/64MiB_4_lanes", |b| b.iter(mpt_stripes));
    g.bench_function("cma_plan/5GiB_8_threads", |b| b.iter(cma_plan));
    g.throughput(Throughput::Elements(WINDOW));
    for (name, reversed) in [("in_order", false), ("reversed", true)] {
        let mut seq = Sequencer::default();
        let mut next = 0;
        g.bench_function(BenchmarkId::new("sequencer_window_8", name), |b| {
            b.iter(|| sequence(&mut seq, &mut next, reversed))
        });
    }
    g.finish();
}

// ---------------------------------------------------------------------------------------------
// Allocation audit: heap allocations per call of each path, counted once before measuring.

/// The system allocator, counting allocations while [`COUNTING`] is on (a relaxed load
/// otherwise, so the measurements are not skewed).
struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

// SAFETY: every call is forwarded unchanged to the system allocator.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        System.alloc(layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        System.alloc_zeroed(layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        System.realloc(ptr, layout, new_size)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Heap allocations per call of `f`, after one warm-up call (which may grow reused buffers).
fn allocations_per_call<R>(mut f: impl FnMut() -> R) -> f64 {
    const CALLS: u64 = 100;
    black_box(f());
    ALLOCATIONS.store(0, Ordering::Relaxed);
    COUNTING.store(true, Ordering::Relaxed);
    for _ in 0..CALLS {
        black_box(f());
    }
    COUNTING.store(false, Ordering::Relaxed);
    ALLOCATIONS.load(Ordering::Relaxed) as f64 / CALLS as f64
}

fn audit_allocations(_: &mut Criterion) {
    let limits = Limits::default();
    let report = |name: &str, n: f64| eprintln!("allocations per call: {name:<40} {n:>6.2}");
    for n in [1, 16] {
        let msg = message(n);
        let mut buf = Vec::new();
        let enc = allocations_per_call(|| encode_descriptor(&mut buf, 42, &msg));
        let name = format!("wire/encode_descriptor/{n}+{n} ({} B)", buf.len());
        report(&name, enc);
        let dec = allocations_per_call(|| wire::decode_frame(&buf[4..], &limits).unwrap());
        report(&format!("wire/decode_descriptor/{n}+{n}"), dec);
    }
    let mut buf = Vec::new();
    report(
        "wire/encode_chunk",
        allocations_per_call(|| encode_chunk(&mut buf, &CHUNK)),
    );
    report(
        "wire/decode_chunk",
        allocations_per_call(|| wire::decode_frame(&buf[4..], &limits).unwrap()),
    );
    let (a, b) = (brochure("10.0.0.1", 4242), brochure("10.0.0.1", 4343));
    report(
        "negotiate/choose/same_host",
        allocations_per_call(|| negotiate::choose(&a, &b).unwrap()),
    );
    #[cfg(target_os = "linux")]
    {
        use actorpipe::internal::backend::shm::ring;
        let (mut p, mut r) = ring::in_memory(ring::DEFAULT_CAPACITY).unwrap();
        let (src, mut dst) = (vec![1u8; 4096], vec![0u8; 4096]);
        report(
            "ring/write_read/4KiB",
            allocations_per_call(|| {
                p.write(&[IoSlice::new(&src)]).unwrap();
                r.read(&mut dst).unwrap()
            }),
        );
    }
    report("planning/basic_chunks", allocations_per_call(basic_chunks));
    report("planning/mpt_stripes", allocations_per_call(mpt_stripes));
    report("planning/cma_plan", allocations_per_call(cma_plan));
    for (name, reversed) in [("in_order", false), ("reversed", true)] {
        let (mut seq, mut next) = (Sequencer::default(), 0);
        report(
            &format!("planning/sequencer_window_8/{name}"),
            allocations_per_call(|| sequence(&mut seq, &mut next, reversed)),
        );
    }
}

criterion_group!(
    benches,
    audit_allocations,
    bench_wire,
    bench_negotiate,
    bench_ring,
    bench_planning
);
criterion_main!(benches);
