//! Property tests of the wire decoder: any bytes decode or fail cleanly, never panic, and never
//! make the decoder allocate more than its limits and the input justify. A peer announcing
//! absurd counts or sizes is refused before anything is allocated for them.
//!
//! A counting global allocator measures, per thread and only inside [`measure`], the largest
//! single block, the bytes requested in all, and the peak of live bytes. Bounds (found by
//! experiment, see `allocation_profile`, run by hand with `--ignored --nocapture`), with `L` the
//! frame's length after its prefix:
//!
//! - hand-decoded frames (descriptor, chunk, ack): largest block
//!   ≤ 11·L + 256, all requests together ≤ 16·L + 1 KiB. The factor comes from list capacities:
//!   a payload list reserves one 32-byte entry per 3 remaining bytes (10.7·L), a tensor list one
//!   48-byte entry per 7 (6.9·L), both also capped by the count limits (32 KiB and 192 KiB under
//!   the defaults). Measured worst: 10.64·L for one block, 11.43·L in all;
//! - serde frames (hello, choice, reject, close, join): serde preallocates a sequence for the
//!   announced count; the decoder first refuses any count or length larger than the bytes left,
//!   so a sequence reserves at most its element size per byte of frame (`SERDE_PER_BYTE`),
//!   allowed on top of the above at each nesting level. An 8-byte hello announcing 2³²−1 offers
//!   is refused without allocating (`serde_frames_stay_within_a_tight_frame_limit`).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use actorpipe::internal::message::TensorDescriptor;
use actorpipe::internal::message::{
    Descriptor, Device, Message, Payload, PayloadDescriptor, Tensor,
};
use actorpipe::internal::negotiate::{
    Brochure, ChannelChoice, ChannelOffer, Choice, DeviceKind, DevicePair, Hello, Join, Offer,
    Purpose,
};
use actorpipe::internal::transport::stream::read_frame;
use actorpipe::internal::wire::{
    self, check_frame_len, decode_frame, encode_descriptor, encode_frame, encode_serde, Ack,
    ChunkHeader, Farewell, Frame, FrameKind, Limits, WireDescriptor, WireError,
};
use actorpipe::{Error, Origin};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::Config as ProptestConfig;

// ---------------------------------------------------------------------------------------------
// The counting allocator.

/// What one thread allocated while measuring.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Usage {
    /// Largest single block requested (alloc or realloc).
    largest: usize,
    /// Bytes requested in all (every alloc, every realloc's new size).
    total: usize,
    /// Live bytes now (blocks freed that were allocated before measuring are ignored).
    live: usize,
    /// Most live bytes at once.
    peak: usize,
}

thread_local! {
    static MEASURING: Cell<bool> = const { Cell::new(false) };
    static USAGE: Cell<Usage> = const {
        Cell::new(Usage { largest: 0, total: 0, live: 0, peak: 0 })
    };
}

fn note(grown: usize, freed: usize) {
    // `try_with`: the allocator also runs while thread locals are torn down.
    let on = MEASURING.try_with(|m| m.get()).unwrap_or(false);
    if !on {
        return;
    }
    let _ = USAGE.try_with(|u| {
        let mut v = u.get();
        v.largest = v.largest.max(grown);
        v.total += grown;
        v.live = v.live.saturating_sub(freed) + grown;
        v.peak = v.peak.max(v.live);
        u.set(v);
    });
}

struct Counting;

// SAFETY: every call is forwarded unchanged to the system allocator; we only count.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size(), 0);
        System.alloc(layout)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size(), 0);
        System.alloc_zeroed(layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size, layout.size());
        System.realloc(ptr, layout, new_size)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        note(0, layout.size());
        System.dealloc(ptr, layout)
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Runs `f` and reports what this thread allocated meanwhile (what `f` returns is dropped after
/// measuring, so it counts as live).
fn measure<T>(f: impl FnOnce() -> T) -> (T, Usage) {
    // The thread's runtime for `read_all` is built outside any measurement.
    RUNTIME.with(|_| ());
    USAGE.with(|u| u.set(Usage::default()));
    MEASURING.with(|m| m.set(true));
    let out = f();
    MEASURING.with(|m| m.set(false));
    (out, USAGE.with(|u| u.get()))
}

// ---------------------------------------------------------------------------------------------
// Limits and bounds.

/// The limits a cautious deployment might set (those the wire fuzz target decodes under too).
fn tight() -> Limits {
    let [_, tight] = actorpipe::internal::fuzz::wire_limits();
    tight
}

/// Both limit sets every decoding property runs under.
fn limit_sets() -> [Limits; 2] {
    [Limits::default(), tight()]
}

/// What a serde frame may reserve per byte of its length, at each nesting level.
const SERDE_PER_BYTE: usize = wire::SERDE_RESERVE_PER_BYTE;

/// Whether a frame kind may be decoded by serde: all but the three decoded by hand, so that a
/// kind added later gets the serde allowance until it is listed here.
fn is_serde_kind(kind: u8) -> bool {
    !matches!(kind, 4 | 5 | 8)
}

/// Per byte of frame, the most a hand decoder may reserve as one block: a payload list's
/// capacity is capped at one entry per 3 remaining bytes and an entry takes 32 bytes (32 / 3 =
/// 10.7; a tensor's takes 48 for at least 7 bytes: 6.9).
const LARGEST_PER_BYTE: usize = 11;
/// Per byte of frame, the most all of one decode's requests may add up to (measured: 11.5).
const TOTAL_PER_BYTE: usize = 16;

/// The most one decode of `frame` may request as one block, and in all.
fn bounds(frame: &[u8]) -> (usize, usize) {
    let l = frame.len();
    let (largest, total) = (LARGEST_PER_BYTE * l + 256, TOTAL_PER_BYTE * l + 1024);
    match frame.first() {
        // A sequence preallocation can be open at each of the few nesting levels at once.
        Some(&k) if is_serde_kind(k) => {
            (largest + SERDE_PER_BYTE * l, total + 4 * SERDE_PER_BYTE * l)
        }
        _ => (largest, total),
    }
}

/// Decodes `frame` under `limits`, asserting it does not panic (a panic fails the property with
/// the input) and stays within [`bounds`]. Returns the result.
fn decode_checked(frame: &[u8], limits: &Limits) -> Result<Frame, WireError> {
    let (r, used) = measure(|| decode_frame(frame, limits));
    let (largest, total) = bounds(frame);
    assert!(
        used.largest <= largest && used.total <= total,
        "decoding {} bytes {:02x?} under {limits:?} used {used:?}, bounds: largest {largest}, total {total}",
        frame.len(),
        &frame[..frame.len().min(64)],
    );
    r
}

// ---------------------------------------------------------------------------------------------
// Generators.

/// A MessagePack token, to build byte strings that look like frames far more often than random
/// bytes do (announced counts and lengths especially).
#[derive(Debug, Clone)]
enum Token {
    Uint(u64),
    Int(i64),
    Array(u32),
    Map(u32),
    BinHeader(u32),
    StrHeader(u32),
    Bin(Vec<u8>),
    Str(String),
    Nil,
    Bool(bool),
    Ext(u32, i8),
    Raw(Vec<u8>),
}

fn count() -> impl Strategy<Value = u32> {
    prop_oneof![
        4 => 0u32..8,
        1 => Just(255u32),
        1 => Just(65_535u32),
        1 => Just(u32::MAX),
        1 => any::<u32>(),
    ]
}

fn token() -> impl Strategy<Value = Token> {
    prop_oneof![
        3 => prop_oneof![0u64..300, Just(u64::MAX), any::<u64>()].prop_map(Token::Uint),
        1 => any::<i64>().prop_map(Token::Int),
        3 => count().prop_map(Token::Array),
        1 => count().prop_map(Token::Map),
        1 => count().prop_map(Token::BinHeader),
        1 => count().prop_map(Token::StrHeader),
        1 => vec(any::<u8>(), 0..40).prop_map(Token::Bin),
        1 => "[a-z]{0,12}".prop_map(Token::Str),
        1 => Just(Token::Nil),
        1 => any::<bool>().prop_map(Token::Bool),
        1 => (count(), any::<i8>()).prop_map(|(n, t)| Token::Ext(n, t)),
        1 => vec(any::<u8>(), 1..8).prop_map(Token::Raw),
    ]
}

fn put_token(b: &mut Vec<u8>, t: &Token) {
    use rmp::encode::*;
    // Writing into a Vec cannot fail.
    let _ = match t {
        Token::Uint(v) => write_uint(b, *v).map(drop),
        Token::Int(v) => write_sint(b, *v).map(drop),
        Token::Array(n) => write_array_len(b, *n).map(drop),
        Token::Map(n) => write_map_len(b, *n).map(drop),
        Token::BinHeader(n) => write_bin_len(b, *n).map(drop),
        Token::StrHeader(n) => write_str_len(b, *n).map(drop),
        Token::Bin(v) => write_bin(b, v).map(drop),
        Token::Str(s) => write_str(b, s).map(drop),
        Token::Nil => write_nil(b).map_err(ValueWriteError::InvalidMarkerWrite),
        Token::Bool(v) => write_bool(b, *v).map_err(ValueWriteError::InvalidMarkerWrite),
        Token::Ext(n, ty) => write_ext_meta(b, *n, *ty).map(drop),
        Token::Raw(v) => {
            b.extend_from_slice(v);
            Ok(())
        }
    };
}

/// A frame kind byte: mostly real kinds, sometimes anything.
fn kind() -> impl Strategy<Value = u8> {
    prop_oneof![6 => 1u8..=8, 1 => any::<u8>()]
}

/// Bytes after a length prefix: random bytes, or a kind byte and a MessagePack token soup.
fn frame_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        1 => vec(any::<u8>(), 0..256),
        1 => (kind(), vec(any::<u8>(), 0..256)).prop_map(|(k, mut rest)| {
            rest.insert(0, k);
            rest
        }),
        3 => (kind(), vec(token(), 0..24)).prop_map(|(k, tokens)| {
            let mut b = vec![k];
            for t in &tokens {
                put_token(&mut b, t);
            }
            b
        }),
        2 => announce_then_fill(),
    ]
}

/// A descriptor that announces many payloads or tensors, followed by up to 64 KiB made of one
/// short pattern repeated: minimal valid entries, or garbage. This is what makes a decoder
/// reserve the most for the bytes it was given.
fn announce_then_fill() -> impl Strategy<Value = Vec<u8>> {
    let payload_entry = vec![0x92, 0x00, 0xc4, 0x00];
    let tensor_entry = vec![0x96, 0x00, 0x00, 0xc0, 0x00, 0xc4, 0x00, 0xc4, 0x00];
    let pattern = prop_oneof![
        Just(payload_entry),
        Just(tensor_entry),
        Just(vec![0u8]),
        bytes(12).prop_filter("non-empty", |v| !v.is_empty()),
    ];
    let n = prop_oneof![0u32..16, Just(1024u32), Just(4096u32), 0u32..=4096];
    (any::<bool>(), n, pattern, 0usize..16_384).prop_map(|(tensors, n, pattern, reps)| {
        use rmp::encode::*;
        let mut b = vec![FrameKind::Descriptor as u8];
        write_array_len(&mut b, 4).unwrap();
        write_uint(&mut b, 0).unwrap();
        write_bin(&mut b, b"").unwrap();
        if tensors {
            write_array_len(&mut b, 0).unwrap();
        }
        write_array_len(&mut b, n).unwrap();
        let room = (64 << 10) / pattern.len();
        for _ in 0..reps.min(room) {
            b.extend_from_slice(&pattern);
        }
        b
    })
}

fn device() -> impl Strategy<Value = Device> {
    prop_oneof![
        3 => Just(Device::Cpu),
        1 => (0u32..8).prop_map(Device::Cuda),
        1 => Just(Device::Cuda(u32::MAX)),
    ]
}

fn bytes(max: usize) -> impl Strategy<Value = Vec<u8>> {
    vec(any::<u8>(), 0..=max)
}

/// A real message with small buffers, and each tensor's route (channel index, channel bytes).
fn message() -> impl Strategy<Value = (Message, Vec<(u8, Vec<u8>)>)> {
    let payload = (bytes(48), bytes(12)).prop_map(|(data, metadata)| Payload { data, metadata });
    let tensor = (
        bytes(48),
        bytes(12),
        prop::option::of(device()),
        any::<u8>(),
        bytes(32),
    )
        .prop_map(|(data, metadata, target_device, ch, cd)| {
            let mut t = Tensor::cpu(data);
            t.metadata = metadata;
            t.target_device = target_device;
            (t, (ch, cd))
        });
    (bytes(40), vec(payload, 0..5), vec(tensor, 0..5)).prop_map(|(metadata, payloads, tensors)| {
        let (tensors, routes): (Vec<_>, Vec<_>) = tensors.into_iter().unzip();
        (
            Message {
                metadata,
                payloads,
                tensors,
            },
            routes,
        )
    })
}

/// A descriptor as a peer announces it: sizes up to `max_size`, nothing behind them.
fn announced(max_size: u64) -> impl Strategy<Value = WireDescriptor> {
    let size = prop_oneof![
        0..=max_size.min(4096),
        Just(max_size),
        Just(max_size.min(4 << 30)),
        0..=max_size,
    ];
    let payload = (size.clone(), bytes(12))
        .prop_map(|(length, metadata)| PayloadDescriptor { length, metadata });
    let tensor = (
        size,
        device(),
        prop::option::of(device()),
        bytes(12),
        any::<u8>(),
        bytes(32),
    )
        .prop_map(|(length, source_device, target_device, metadata, ch, cd)| {
            let t = TensorDescriptor {
                length,
                source_device,
                target_device,
                metadata,
            };
            (t, (ch, cd))
        });
    (
        any::<u64>(),
        bytes(40),
        vec(payload, 0..6),
        vec(tensor, 0..6),
    )
        .prop_map(|(seq, metadata, payloads, tensors)| {
            let (tensors, routes): (Vec<_>, Vec<_>) = tensors.into_iter().unzip();
            WireDescriptor {
                seq,
                descriptor: Descriptor {
                    metadata,
                    payloads,
                    tensors,
                },
                routes,
            }
        })
}

fn device_code(d: Device) -> u64 {
    match d {
        Device::Cpu => 0,
        Device::Cuda(i) => i as u64 + 1,
    }
}

/// Encodes a descriptor body by hand, following the layout in `src/wire/descriptor.rs`, so that
/// sizes can be announced without buffers behind them. `descriptor_encoders_agree` checks it
/// against `wire::encode_descriptor`.
fn encode_announced(d: &WireDescriptor) -> Vec<u8> {
    use rmp::encode::*;
    let mut b = Vec::new();
    let desc = &d.descriptor;
    write_array_len(&mut b, 4).unwrap();
    write_uint(&mut b, d.seq).unwrap();
    write_bin(&mut b, &desc.metadata).unwrap();
    write_array_len(&mut b, desc.payloads.len() as u32).unwrap();
    for p in &desc.payloads {
        write_array_len(&mut b, 2).unwrap();
        write_uint(&mut b, p.length).unwrap();
        write_bin(&mut b, &p.metadata).unwrap();
    }
    write_array_len(&mut b, desc.tensors.len() as u32).unwrap();
    for (t, (ch, data)) in desc.tensors.iter().zip(&d.routes) {
        write_array_len(&mut b, 6).unwrap();
        write_uint(&mut b, t.length).unwrap();
        write_uint(&mut b, device_code(t.source_device)).unwrap();
        match t.target_device {
            Some(dev) => write_uint(&mut b, device_code(dev)).map(drop).unwrap(),
            None => write_nil(&mut b).unwrap(),
        }
        write_uint(&mut b, *ch as u64).unwrap();
        write_bin(&mut b, data).unwrap();
        write_bin(&mut b, &t.metadata).unwrap();
    }
    b
}

/// A whole frame (prefix, kind, body) around a descriptor body.
fn descriptor_frame(body: &[u8]) -> Vec<u8> {
    let mut f = Vec::new();
    encode_frame(&mut f, FrameKind::Descriptor, |b| b.extend_from_slice(body));
    f
}

fn name() -> impl Strategy<Value = String> {
    "[a-z:/0-9.]{0,16}"
}

/// One valid frame of any kind, whole (with its length prefix).
fn valid_frame() -> impl Strategy<Value = Vec<u8>> {
    let offer = (name(), any::<i32>(), name(), vec(name(), 0..3)).prop_map(
        |(name, priority, domain, addresses)| Offer {
            name,
            priority,
            domain,
            addresses,
        },
    );
    let kind = prop_oneof![Just(DeviceKind::Cpu), Just(DeviceKind::Cuda)];
    let pair = (kind.clone(), kind).prop_map(|(source, target)| DevicePair { source, target });
    let channel = (name(), any::<i32>(), name(), pair.clone(), any::<u32>()).prop_map(
        |(name, priority, domain, devices, connections)| ChannelOffer {
            name,
            priority,
            domain,
            devices,
            connections,
        },
    );
    let proof = || prop::option::of(bytes(32).prop_map(serde_bytes::ByteBuf::from));
    let hello = (vec(offer, 0..3), vec(channel, 0..3), bytes(32), proof()).prop_map(
        |(transports, channels, nonce, proof)| {
            let mut f = Vec::new();
            let brochure = Brochure {
                transports,
                channels,
                remote: false,
            };
            let hello = Hello {
                brochure,
                nonce,
                proof,
            };
            encode_serde(&mut f, FrameKind::Hello, &hello);
            f
        },
    );
    let choice = (
        name(),
        vec((name(), pair, any::<u32>()), 0..3),
        any::<u64>(),
        proof(),
    )
        .prop_map(|(transport, channels, token, proof)| {
            let channels = channels
                .into_iter()
                .map(|(name, devices, connections)| ChannelChoice {
                    name,
                    devices,
                    connections,
                })
                .collect();
            let mut f = Vec::new();
            let c = Choice {
                transport,
                channels,
                token,
                proof,
                remote: false,
            };
            encode_serde(&mut f, FrameKind::Choice, &c);
            f
        });
    let reject = name().prop_map(|s| {
        let mut f = Vec::new();
        encode_serde(&mut f, FrameKind::Reject, &s);
        f
    });
    let close = (name(), any::<bool>()).prop_map(|(reason, graceful)| {
        let mut f = Vec::new();
        encode_serde(&mut f, FrameKind::Close, &Farewell { reason, graceful });
        f
    });
    let join = (
        any::<u64>(),
        prop::option::of((any::<u32>(), any::<u32>())),
        proof(),
    )
        .prop_map(|(token, lane, proof)| {
            let purpose = match lane {
                None => Purpose::Control,
                Some((channel, lane)) => Purpose::Channel { channel, lane },
            };
            let mut f = Vec::new();
            let join = Join {
                token,
                purpose,
                proof,
            };
            encode_serde(&mut f, FrameKind::Join, &join);
            f
        });
    let descriptor = message().prop_map(|(m, routes)| {
        let mut f = Vec::new();
        encode_frame(&mut f, FrameKind::Descriptor, |b| {
            encode_descriptor(b, 7, &m, |i, d| {
                d.set(&routes[i].1);
                routes[i].0
            })
        });
        f
    });
    let chunk = (any::<u64>(), any::<u32>(), any::<u64>(), any::<u64>()).prop_map(
        |(seq, tensor, offset, length)| {
            let mut f = Vec::new();
            let h = ChunkHeader {
                seq,
                tensor,
                offset,
                length,
            };
            encode_frame(&mut f, FrameKind::Chunk, |b| wire::encode_chunk(b, &h));
            f
        },
    );
    let ack = (any::<u64>(), any::<u32>(), any::<bool>()).prop_map(|(seq, tensor, ok)| {
        let mut f = Vec::new();
        encode_frame(&mut f, FrameKind::Ack, |b| {
            wire::encode_ack(b, &Ack { seq, tensor, ok })
        });
        f
    });
    prop_oneof![
        1 => hello,
        1 => choice,
        1 => reject,
        1 => close,
        1 => join,
        3 => descriptor,
        1 => chunk,
        1 => ack,
    ]
}

/// A change to a valid frame.
#[derive(Debug, Clone)]
enum Mutation {
    Flip(usize, u8),
    Set(usize, u8),
    Truncate(usize),
    Extend(Vec<u8>),
    Insert(usize, Vec<u8>),
    Remove(usize, usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        3 => (any::<usize>(), 0u8..8).prop_map(|(i, b)| Mutation::Flip(i, b)),
        2 => (any::<usize>(), prop_oneof![Just(0xffu8), Just(0xdd), Just(0xc6), Just(0xcf), any::<u8>()])
            .prop_map(|(i, v)| Mutation::Set(i, v)),
        1 => any::<usize>().prop_map(Mutation::Truncate),
        1 => bytes(16).prop_map(Mutation::Extend),
        1 => (any::<usize>(), bytes(8)).prop_map(|(i, v)| Mutation::Insert(i, v)),
        1 => (any::<usize>(), 1usize..6).prop_map(|(i, n)| Mutation::Remove(i, n)),
    ]
}

/// Applies `m` to the frame body (after the length prefix, kind byte included).
fn mutate(body: &mut Vec<u8>, m: &Mutation) {
    let at = |i: usize, len: usize| if len == 0 { 0 } else { i % len };
    match m {
        Mutation::Flip(i, bit) if !body.is_empty() => {
            let i = at(*i, body.len());
            body[i] ^= 1 << bit;
        }
        Mutation::Set(i, v) if !body.is_empty() => {
            let i = at(*i, body.len());
            body[i] = *v;
        }
        Mutation::Truncate(i) => body.truncate(at(*i, body.len() + 1)),
        Mutation::Extend(v) => body.extend_from_slice(v),
        Mutation::Insert(i, v) => {
            let i = at(*i, body.len() + 1);
            body.splice(i..i, v.iter().copied());
        }
        Mutation::Remove(i, n) if !body.is_empty() => {
            let i = at(*i, body.len());
            let end = (i + n).min(body.len());
            body.drain(i..end);
        }
        _ => {}
    }
}

/// `cases` per property, or `PROPTEST_CASES` when set (for a longer run by hand).
fn config(cases: u32) -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(cases);
    ProptestConfig {
        cases,
        // Failures are reported with their input; no regression files in the tree.
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

thread_local! {
    static RUNTIME: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a current-thread runtime");
}

/// Reads frames from `stream` with `read_frame` until it fails; returns the frames read and the
/// final error.
fn read_all(stream: &[u8], limits: &Limits) -> (Vec<Frame>, Error) {
    RUNTIME.with(|rt| {
        rt.block_on(async {
            let mut r = stream;
            let mut buf = Vec::new();
            let origin = Origin::default();
            let mut frames = Vec::new();
            loop {
                match read_frame(&mut r, &mut buf, limits, &origin).await {
                    Ok(f) => frames.push(f),
                    Err(e) => return (frames, e),
                }
            }
        })
    })
}

// ---------------------------------------------------------------------------------------------
// Properties.

proptest! {
    #![proptest_config(config(2000))]

    /// (a, b) Any bytes: a frame or an error, never a panic, within the allocation bounds.
    #[test]
    fn any_bytes_decode_or_fail_within_bounds(frame in frame_bytes()) {
        for limits in limit_sets() {
            let _ = decode_checked(&frame, &limits);
        }
    }

    /// (a, b) Any stream through `read_frame`: the frame buffer never exceeds the frame limit,
    /// and decoding stays within its bounds.
    #[test]
    fn any_stream_reads_or_fails_within_bounds(
        frames in vec((prop_oneof![3 => Just(None), 1 => any::<u32>().prop_map(Some)], frame_bytes()), 1..4),
        tail in bytes(8),
    ) {
        let mut stream = Vec::new();
        for (len, f) in &frames {
            let len = len.unwrap_or(f.len() as u32);
            stream.extend_from_slice(&len.to_le_bytes());
            stream.extend_from_slice(f);
        }
        stream.extend_from_slice(&tail);
        for limits in limit_sets() {
            let ((_, e), used) = measure(|| read_all(&stream, &limits));
            // The frame buffer, or what decoding a frame may take (random prefixes cut frames
            // anywhere, so any of them may be read as a serde frame).
            let allowed = (limits.max_frame_size as usize)
                .max((LARGEST_PER_BYTE + SERDE_PER_BYTE) * stream.len() + 256);
            prop_assert!(used.largest <= allowed, "{used:?} over {allowed} reading {stream:02x?}");
            // The stream always ends, so reading always ends in an error.
            prop_assert!(!matches!(e, Error::InvalidArgument { .. }), "{e}");
        }
    }

    /// (c) Real messages: `encode_descriptor` then decode gives back the message's descriptor
    /// and each tensor's route, and the hand encoder agrees byte for byte.
    #[test]
    fn descriptor_encoders_agree_and_round_trip((m, routes) in message(), seq in any::<u64>()) {
        let mut body = Vec::new();
        encode_descriptor(&mut body, seq, &m, |i, d| {
            d.set(&routes[i].1);
            routes[i].0
        });
        let expected = WireDescriptor { seq, descriptor: m.descriptor(), routes: routes.clone() };
        prop_assert_eq!(&body, &encode_announced(&expected));
        let frame = descriptor_frame(&body);
        let got = decode_checked(&frame[4..], &Limits::default());
        prop_assert_eq!(got, Ok(Frame::Descriptor(expected)));
    }

    /// (c) Announced sizes up to 4 GiB and beyond round-trip without anything being allocated
    /// for them.
    #[test]
    fn announced_sizes_round_trip_without_allocating(d in announced(Limits::default().max_payload_size)) {
        let frame = descriptor_frame(&encode_announced(&d));
        let got = decode_checked(&frame[4..], &Limits::default());
        prop_assert_eq!(got, Ok(Frame::Descriptor(d)));
    }

    /// (c) With the size limits opened all the way, any u64 size is legal.
    #[test]
    fn any_u64_size_round_trips_under_open_limits(d in announced(u64::MAX)) {
        let open = Limits {
            max_payload_size: u64::MAX,
            max_tensor_size: u64::MAX,
            ..Limits::default()
        };
        let frame = descriptor_frame(&encode_announced(&d));
        let got = decode_checked(&frame[4..], &open);
        prop_assert_eq!(got, Ok(Frame::Descriptor(d)));
    }

    /// (d) Valid frames of every kind with bytes flipped, set, cut, added or removed: no panic,
    /// within bounds, through `decode_frame` and through `read_frame`.
    #[test]
    fn mutated_frames_never_panic(frame in valid_frame(), ms in vec(mutation(), 1..4), fix_len in any::<bool>()) {
        let mut body = frame[4..].to_vec();
        for m in &ms {
            mutate(&mut body, m);
        }
        for limits in limit_sets() {
            let _ = decode_checked(&body, &limits);
        }
        let mut stream = if fix_len { (body.len() as u32).to_le_bytes().to_vec() } else { frame[..4].to_vec() };
        stream.extend_from_slice(&body);
        let _ = read_all(&stream, &Limits::default());
    }

    /// (e) A descriptor with one count or size raised anywhere above its limit is refused with
    /// `WireError::Limit` naming it, before anything is allocated for it.
    #[test]
    fn absurd_counts_and_sizes_are_refused_before_allocation(
        d in announced(1 << 20),
        which in 0usize..5,
        excess in prop_oneof![Just(u64::MAX), any::<u64>()],
    ) {
        let limits = tight();
        let (body, limit, max) = absurd(&d, which, excess, &limits);
        let frame = descriptor_frame(&body);
        let (got, used) = measure(|| decode_frame(&frame[4..], &limits));
        match got {
            Err(WireError::Limit { limit: l, value, max: m }) => {
                prop_assert_eq!(l, limit);
                prop_assert_eq!(m, max);
                prop_assert!(value > max);
            }
            other => prop_assert!(false, "expected a {limit} limit error, got {other:?}"),
        }
        prop_assert!(used.largest <= LARGEST_PER_BYTE * frame.len() + 256, "{used:?}");
    }
}

/// `d` encoded with one field pushed above its limit: 0 payload count, 1 tensor count,
/// 2 payload size, 3 tensor size, 4 a metadata length. Returns the body, the limit's name and
/// its maximum.
fn absurd(
    d: &WireDescriptor,
    which: usize,
    excess: u64,
    l: &Limits,
) -> (Vec<u8>, &'static str, u64) {
    use rmp::encode::*;
    let above = |max: u64, cap: u64| max + 1 + excess % (cap - max);
    let mut d = d.clone();
    // Keep the counts under the tight limits so that only the chosen field is over.
    d.descriptor.payloads.truncate(l.max_payloads as usize);
    d.descriptor.tensors.truncate(l.max_tensors as usize);
    d.routes.truncate(l.max_tensors as usize);
    let total_meta: usize = d.descriptor.metadata.len()
        + d.descriptor
            .payloads
            .iter()
            .map(|p| p.metadata.len())
            .sum::<usize>()
        + d.descriptor
            .tensors
            .iter()
            .map(|t| t.metadata.len())
            .sum::<usize>()
        + d.routes.iter().map(|r| r.1.len()).sum::<usize>();
    if total_meta as u64 > l.max_metadata_size {
        d.descriptor.metadata.clear();
        d.descriptor
            .payloads
            .iter_mut()
            .for_each(|p| p.metadata.clear());
        d.descriptor
            .tensors
            .iter_mut()
            .for_each(|t| t.metadata.clear());
        d.routes.iter_mut().for_each(|r| r.1.clear());
    }
    let mut b = Vec::new();
    write_array_len(&mut b, 4).unwrap();
    write_uint(&mut b, d.seq).unwrap();
    match which {
        // The count is announced; the entries that would follow are not there.
        0 => {
            write_bin(&mut b, &d.descriptor.metadata).unwrap();
            let n = above(l.max_payloads as u64, u32::MAX as u64 + 1);
            write_array_len(&mut b, n as u32).unwrap();
            (b, "payload count", l.max_payloads as u64)
        }
        1 => {
            // Everything up to the tensor list, whose (empty) header 0x90 is replaced.
            let mut e = d.clone();
            e.descriptor.tensors.clear();
            e.routes.clear();
            let mut body = encode_announced(&e);
            assert_eq!(body.pop(), Some(0x90));
            let n = above(l.max_tensors as u64, u32::MAX as u64 + 1);
            write_array_len(&mut body, n as u32).unwrap();
            (body, "tensor count", l.max_tensors as u64)
        }
        2 => {
            let mut e = d.clone();
            e.descriptor.payloads.truncate(1);
            if e.descriptor.payloads.is_empty() {
                e.descriptor.payloads.push(PayloadDescriptor::default());
            }
            e.descriptor.payloads[0].length = above(l.max_payload_size, u64::MAX);
            (encode_announced(&e), "payload size", l.max_payload_size)
        }
        3 => {
            let mut e = d.clone();
            if e.descriptor.tensors.is_empty() {
                e.descriptor.tensors.push(TensorDescriptor {
                    length: 0,
                    source_device: Device::Cpu,
                    target_device: None,
                    metadata: vec![],
                });
                e.routes.push((0, vec![]));
            }
            e.descriptor.tensors[0].length = above(l.max_tensor_size, u64::MAX);
            (encode_announced(&e), "tensor size", l.max_tensor_size)
        }
        _ => {
            // A message metadata length far over the whole metadata budget; its bytes are not
            // there.
            let n = above(l.max_metadata_size, u32::MAX as u64 + 1);
            write_bin_len(&mut b, n as u32).unwrap();
            (b, "metadata size", l.max_metadata_size)
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Fixed cases.

/// (e) The largest announcements there are, one field at a time, under the default limits.
#[test]
fn maximal_announcements_are_refused_without_allocating() {
    use rmp::encode::*;
    let l = Limits::default();
    let head = |b: &mut Vec<u8>| {
        write_array_len(b, 4).unwrap();
        write_uint(b, 0).unwrap();
    };
    let mut cases: Vec<(Vec<u8>, &str, u64)> = Vec::new();
    // Message metadata of u32::MAX bytes.
    let mut b = Vec::new();
    head(&mut b);
    write_bin_len(&mut b, u32::MAX).unwrap();
    cases.push((b, "metadata size", u32::MAX as u64));
    // u32::MAX payloads.
    let mut b = Vec::new();
    head(&mut b);
    write_bin(&mut b, b"").unwrap();
    write_array_len(&mut b, u32::MAX).unwrap();
    cases.push((b, "payload count", u32::MAX as u64));
    // A payload of u64::MAX bytes.
    let mut b = Vec::new();
    head(&mut b);
    write_bin(&mut b, b"").unwrap();
    write_array_len(&mut b, 1).unwrap();
    write_array_len(&mut b, 2).unwrap();
    write_uint(&mut b, u64::MAX).unwrap();
    cases.push((b.clone(), "payload size", u64::MAX));
    // Payload metadata of u32::MAX bytes.
    let mut b = Vec::new();
    head(&mut b);
    write_bin(&mut b, b"").unwrap();
    write_array_len(&mut b, 1).unwrap();
    write_array_len(&mut b, 2).unwrap();
    write_uint(&mut b, 1).unwrap();
    write_bin_len(&mut b, u32::MAX).unwrap();
    cases.push((b, "metadata size", u32::MAX as u64));
    // u32::MAX tensors.
    let tensors_head = |b: &mut Vec<u8>| {
        head(b);
        write_bin(b, b"").unwrap();
        write_array_len(b, 0).unwrap();
    };
    let mut b = Vec::new();
    tensors_head(&mut b);
    write_array_len(&mut b, u32::MAX).unwrap();
    cases.push((b, "tensor count", u32::MAX as u64));
    // A tensor of u64::MAX bytes.
    let mut b = Vec::new();
    tensors_head(&mut b);
    write_array_len(&mut b, 1).unwrap();
    write_array_len(&mut b, 6).unwrap();
    write_uint(&mut b, u64::MAX).unwrap();
    cases.push((b, "tensor size", u64::MAX));
    // Channel data, then tensor metadata, of u32::MAX bytes.
    for empty_before in 0..2 {
        let mut b = Vec::new();
        tensors_head(&mut b);
        write_array_len(&mut b, 1).unwrap();
        write_array_len(&mut b, 6).unwrap();
        write_uint(&mut b, 1).unwrap();
        write_uint(&mut b, 0).unwrap();
        write_nil(&mut b).unwrap();
        write_uint(&mut b, 0).unwrap();
        if empty_before == 1 {
            write_bin(&mut b, b"").unwrap();
        }
        write_bin_len(&mut b, u32::MAX).unwrap();
        cases.push((b, "metadata size", u32::MAX as u64));
    }
    for (body, limit, value) in cases {
        let frame = descriptor_frame(&body);
        let (got, used) = measure(|| decode_frame(&frame[4..], &l));
        match got {
            Err(WireError::Limit {
                limit: got,
                value: v,
                ..
            }) => {
                assert_eq!(got, limit, "{body:02x?}");
                assert_eq!(v, value, "{body:02x?}");
            }
            other => panic!("{body:02x?}: expected a {limit} limit error, got {other:?}"),
        }
        assert!(used.largest < 256, "{limit}: {used:?}");
        assert!(used.total < 1024, "{limit}: {used:?}");
    }
}

/// (e) A frame announcing 4 GiB is refused from its prefix alone, and `read_frame` allocates
/// nothing for it.
#[test]
fn absurd_frame_length_is_refused_before_allocation() {
    let l = Limits::default();
    assert!(matches!(
        check_frame_len(u32::MAX, &l),
        Err(WireError::Limit {
            limit: "frame size",
            ..
        })
    ));
    let mut stream = u32::MAX.to_le_bytes().to_vec();
    stream.extend_from_slice(&[4; 64]);
    let ((frames, e), used) = measure(|| read_all(&stream, &l));
    assert!(frames.is_empty());
    assert!(
        matches!(
            e,
            Error::LimitExceeded {
                limit: "frame size",
                value,
                ..
            } if value == u32::MAX as u64
        ),
        "{e:?}"
    );
    assert!(used.largest < 1024, "{used:?}");
}

/// (e) A count at its limit with no entries behind it reserves only what the bytes present
/// could hold.
#[test]
fn counts_at_the_limit_reserve_only_what_the_bytes_justify() {
    use rmp::encode::*;
    let l = Limits::default();
    let mut b = Vec::new();
    write_array_len(&mut b, 4).unwrap();
    write_uint(&mut b, 0).unwrap();
    write_bin(&mut b, b"").unwrap();
    write_array_len(&mut b, 0).unwrap();
    write_array_len(&mut b, l.max_tensors).unwrap();
    b.extend_from_slice(&[0x96, 0x00]);
    let frame = descriptor_frame(&b);
    let (got, used) = measure(|| decode_frame(&frame[4..], &l));
    assert!(matches!(got, Err(WireError::Malformed(_))), "{got:?}");
    assert!(used.largest < 256, "{used:?}");
}

/// Deeply nested containers in a serde frame: refused (rmp-serde's depth limit), no stack
/// overflow on a test thread's stack.
#[test]
fn deep_nesting_is_refused_without_overflowing_the_stack() {
    for &(kind, open) in &[(1u8, 0x91u8), (2, 0x91), (7, 0x81), (6, 0x91)] {
        let mut frame = vec![kind];
        frame.extend(std::iter::repeat_n(open, 100_000));
        for limits in limit_sets() {
            assert!(decode_checked(&frame, &limits).is_err());
        }
    }
    // Nesting inside an unknown field of a map-encoded struct goes through serde's
    // `IgnoredAny`.
    let mut frame = vec![1u8, 0x81, 0xa1, b'x'];
    frame.extend(std::iter::repeat_n(0x91u8, 100_000));
    assert!(decode_checked(&frame, &Limits::default()).is_err());
}

/// Every valid frame kind decodes to what was encoded (a sanity check of the generators the
/// mutation property starts from).
#[test]
fn valid_frames_decode() {
    use proptest::strategy::ValueTree;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    for _ in 0..300 {
        let f = valid_frame().new_tree(&mut runner).unwrap().current();
        assert_eq!(
            u32::from_le_bytes(f[..4].try_into().unwrap()) as usize,
            f.len() - 4
        );
        decode_checked(&f[4..], &Limits::default())
            .unwrap_or_else(|e| panic!("{e:?} decoding {f:02x?}"));
    }
}

/// Serde frames allocate in proportion to their size: nothing over the tight frame limit
/// (4 KiB) for a frame that is itself a few bytes. A hello announcing 2³² offers used to make
/// serde reserve 1 MiB (its cap on preallocating from an announced length); the decoder now
/// refuses the count before serde sees it.
#[test]
fn serde_frames_stay_within_a_tight_frame_limit() {
    // kind Hello, Hello as a 1-array, Brochure as a 2-array, transports: array32 of u32::MAX.
    let frame = [1u8, 0x91, 0x92, 0xdd, 0xff, 0xff, 0xff, 0xff];
    let (r, used) = measure(|| decode_frame(&frame, &tight()));
    assert!(r.is_err());
    assert!(
        used.largest <= tight().max_frame_size as usize,
        "an {}-byte hello made a {} byte allocation ({used:?})",
        frame.len(),
        used.largest
    );
}

/// Measures, for many generated frames, the worst allocation per input byte, by frame kind.
/// Run by hand:
/// `cargo test --test integration wire_props::allocation_profile -- --ignored --nocapture`.
#[test]
#[ignore = "measurement; run by hand with --ignored --nocapture"]
fn allocation_profile() {
    use proptest::strategy::ValueTree;
    use std::collections::BTreeMap;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    // kind → worst (largest block, largest per byte, total per byte, peak live), per byte over
    // frames of 256 bytes or more (below that the fixed part, error messages, dominates).
    let mut worst: BTreeMap<u8, (usize, f64, f64, usize)> = BTreeMap::new();
    let gens: Vec<BoxedStrategy<Vec<u8>>> = vec![
        frame_bytes().boxed(),
        (valid_frame(), vec(mutation(), 1..4))
            .prop_map(|(f, ms)| {
                let mut body = f[4..].to_vec();
                for m in &ms {
                    mutate(&mut body, m);
                }
                body
            })
            .boxed(),
    ];
    for g in &gens {
        for _ in 0..50_000 {
            let f = g.new_tree(&mut runner).unwrap().current();
            let k = f.first().copied().unwrap_or(0);
            let k = if (1..=8).contains(&k) { k } else { 0 };
            for limits in limit_sets() {
                let (_, used) = measure(|| decode_frame(&f, &limits));
                let l = f.len();
                let e = worst.entry(k).or_default();
                e.0 = e.0.max(used.largest);
                if l >= 256 {
                    e.1 = e.1.max(used.largest as f64 / l as f64);
                    e.2 = e.2.max(used.total as f64 / l as f64);
                }
                e.3 = e.3.max(used.peak);
            }
        }
    }
    for (k, (largest, per_byte, total_per_byte, peak)) in worst {
        println!(
            "kind {k}: largest block {largest} B, largest/L {per_byte:.2}, total/L \
             {total_per_byte:.2}, peak live {peak} B"
        );
    }
}
