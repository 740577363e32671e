use super::*;
use crate::message::{Payload, Tensor};

/// The hand-written MessagePack writes what rmp writes and reads what rmp reads (the same
/// values, the same refusals, truncated input included), at every boundary of each form.
#[test]
fn hand_msgpack_matches_rmp() {
    use rmp::encode as e;
    let edges = |max: u64| {
        let mut v = vec![0, 1, 15, 16, 127, 128, 255, 256, 65_535, 65_536];
        v.extend([u32::MAX as u64, u32::MAX as u64 + 1, u64::MAX]);
        v.retain(|&x| x <= max);
        v
    };
    for v in edges(u64::MAX) {
        let (mut ours, mut theirs) = (Vec::new(), Vec::new());
        put_uint(&mut ours, v);
        e::write_uint(&mut theirs, v).unwrap();
        assert_eq!(ours, theirs, "uint {v}");
    }
    for n in edges(u32::MAX as u64) {
        let (mut ours, mut theirs) = (Vec::new(), Vec::new());
        put_array(&mut ours, n as usize);
        e::write_array_len(&mut theirs, n as u32).unwrap();
        assert_eq!(ours, theirs, "array {n}");
    }
    for n in edges(70_000) {
        let data = vec![9u8; n as usize];
        let (mut ours, mut theirs) = (Vec::new(), Vec::new());
        put_bin(&mut ours, &data);
        e::write_bin(&mut theirs, &data).unwrap();
        assert_eq!(ours, theirs, "bin {n}");
    }
    // Reading: every integer form rmp writes (signed ones too), array and bin headers, and
    // markers of other types; then every truncation of each.
    fn written(f: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
        let mut b = Vec::new();
        f(&mut b);
        b
    }
    let mut inputs: Vec<Vec<u8>> = Vec::new();
    for v in edges(u64::MAX) {
        inputs.push(written(|b| drop(e::write_uint(b, v))));
        inputs.push(written(|b| drop(e::write_u64(b, v))));
    }
    let signed = [0i64, 1, -1, -32, -33, 127, -128, 200, -200, 40_000, -40_000];
    for v in signed.into_iter().chain([i64::MIN, i64::MAX]) {
        inputs.push(written(|b| drop(e::write_sint(b, v))));
        inputs.push(written(|b| drop(e::write_i64(b, v))));
    }
    for n in edges(u32::MAX as u64) {
        inputs.push(written(|b| drop(e::write_array_len(b, n as u32))));
        inputs.push(written(|b| drop(e::write_bin_len(b, n as u32))));
    }
    for m in [NIL, 0xc2, 0xca, 0xd9, 0x80, 0xa1, 0xde, 0xc7] {
        inputs.push(vec![m, 1, 2, 3, 4, 5, 6, 7, 8]);
    }
    for input in &inputs {
        for cut in 0..=input.len() {
            let bytes = &input[..cut];
            let mut c = Cursor { rest: bytes };
            let mut r = bytes;
            let ours = c.uint("x").ok();
            let theirs = rmp::decode::read_int::<u64, _>(&mut r).ok();
            assert_eq!(ours, theirs, "uint of {bytes:x?}");
            let mut c = Cursor { rest: bytes };
            let mut r = bytes;
            let ours = c.array("x").ok();
            assert_eq!(
                ours,
                rmp::decode::read_array_len(&mut r).ok(),
                "array {bytes:x?}"
            );
            let mut c = Cursor { rest: bytes };
            let mut r = bytes;
            let ours = c.bin_len("x").ok();
            let theirs = rmp::decode::read_bin_len(&mut r).ok().map(u64::from);
            assert_eq!(ours, theirs, "bin of {bytes:x?}");
            if ours.is_some() {
                // Both consumed the header, and only it.
                assert_eq!(c.rest.len(), r.len(), "bin of {bytes:x?}");
            }
        }
    }
}

fn sample() -> Message {
    let mut t = Tensor::cpu(vec![7; 33]);
    t.metadata = b"tm".to_vec();
    t.target_device = Some(Device::Cuda(3));
    Message::new()
        .with_metadata(b"hello".to_vec())
        .with_payload(Payload {
            data: vec![1; 5],
            metadata: b"pm".to_vec(),
        })
        .with_payload(Payload::new(vec![]))
        .with_tensor(t)
        .with_tensor(Tensor::cpu(vec![]))
}

#[test]
fn descriptor_round_trip() {
    let m = sample();
    let mut buf = Vec::new();
    encode_descriptor(&mut buf, 42, &m, |i, d| {
        d.set(b"cd");
        i as u8
    });
    let d = decode_descriptor(&buf, &Limits::default()).unwrap();
    assert_eq!(d.seq, 42);
    assert_eq!(d.descriptor, m.descriptor());
    assert_eq!(d.routes, vec![(0, b"cd".to_vec()), (1, b"cd".to_vec())]);
}

/// Decoding into a spare descriptor's lists gives what a fresh decode gives, whatever the
/// spare held.
#[test]
fn decoding_into_a_spare_is_decoding() {
    let limits = Limits::default();
    let mut small = Vec::new();
    encode_descriptor(
        &mut small,
        7,
        &Message::new().with_payload(Payload::new(vec![1; 64])),
        |_, _| 0,
    );
    let mut big = Vec::new();
    encode_descriptor(&mut big, 42, &sample(), |i, d| {
        d.set(b"cd");
        i as u8
    });
    let mut spare = None;
    for body in [&small, &big, &big, &small, &small, &big] {
        let d = decode_descriptor_reusing(body, &limits, &mut spare).unwrap();
        assert!(spare.is_none());
        assert_eq!(d, decode_descriptor(body, &limits).unwrap());
        spare = Some(d);
    }
    // A refusal takes the spare too, and leaves nothing behind.
    let truncated = &big[..big.len() - 1];
    assert!(decode_descriptor_reusing(truncated, &limits, &mut spare).is_err());
    assert!(spare.is_none());
}

/// Whatever `small_head` accepts, the general decoder (`decode_head`) accepts with the same
/// values, the same capacity reserved and the same metadata budget left, and stops at the
/// same byte: on every truncation and many one-byte changes of a few bodies, under tight
/// limits too.
#[test]
fn the_small_head_is_the_general_head() {
    let mut bodies = Vec::new();
    for (seq, meta, sizes, tensor) in [
        (0, 0, vec![64], false),
        (127, 3, vec![], false),
        (128, 0, vec![0, 300, 70_000], false),
        (70_000, 255, vec![5], true),
        (u64::MAX, 256, vec![1; 16], false),
    ] {
        let mut m = Message::new().with_metadata(vec![1; meta]);
        for n in sizes {
            m = m.with_payload(Payload {
                data: vec![2; n],
                metadata: vec![3; n % 7],
            });
        }
        if tensor {
            m = m.with_tensor(Tensor::cpu(vec![4; 9]));
        }
        let mut body = Vec::new();
        encode_descriptor(&mut body, seq, &m, |_, _| 0);
        bodies.push(body);
    }
    let limits = [
        Limits::default(),
        Limits {
            max_payloads: 2,
            max_payload_size: 64,
            max_metadata_size: 4,
            ..Limits::default()
        },
    ];
    let inputs = damaged(
        &bodies,
        &[
            0x00, 0x01, 0x7f, 0x90, 0x92, 0x94, 0xc4, 0xc5, 0xcc, 0xd0, 0xdc, 0xff,
        ],
    );
    for limits in &limits {
        for input in &inputs {
            let mut budget = limits.max_metadata_size;
            let mut payloads = Vec::new();
            let small = small_head(input, limits, &mut budget, &mut payloads);
            let mut general_budget = limits.max_metadata_size;
            let mut general_payloads = Vec::new();
            let general = decode_head(input, limits, &mut general_budget, &mut general_payloads);
            if let Some((seq, metadata, rest)) = small {
                let (gseq, gmetadata, c) = general.expect("the general head accepts it");
                assert_eq!((seq, &metadata, rest), (gseq, &gmetadata, c.rest));
                assert_eq!(payloads, general_payloads);
                assert_eq!(payloads.capacity(), general_payloads.capacity());
                assert_eq!(budget, general_budget);
            }
        }
    }
}

/// Whatever `small_tensors` accepts, the general decoder (`decode_tensors`) accepts with the
/// same tensors and routes, the same capacity reserved and the same metadata budget left:
/// on every truncation and many one-byte changes of a few bodies, under tight limits too.
#[test]
fn the_small_tensors_are_the_general_tensors() {
    let mut bodies = Vec::new();
    // Sizes in each form a positive int takes but the 8-byte one (`small_uint` is
    // `small_head`'s, whose test covers that).
    for (sizes, data, meta) in [
        (vec![64], 0, 0),
        (vec![0, 127, 128], 0, 2),
        (vec![300, 70_000, 5, 1], 3, 0),
        (vec![1], 200, 255),
        // Within the tight limits below but for its size.
        (vec![300], 0, 0),
    ] {
        let mut m = Message::new();
        for (i, &n) in sizes.iter().enumerate() {
            let mut t = Tensor::cpu(vec![4; n]);
            t.metadata = vec![5; (meta + i) % 256];
            if i == 1 {
                t.target_device = Some(Device::Cuda(3));
            }
            m = m.with_tensor(t);
        }
        let mut body = Vec::new();
        encode_descriptor(&mut body, 7, &m, |i, d| {
            d.set(&vec![6; (data + i) % MAX_CHANNEL_DATA]);
            i as u8
        });
        bodies.push(body);
    }
    let limits = [
        Limits::default(),
        Limits {
            max_tensors: 2,
            max_tensor_size: 200,
            max_metadata_size: 4,
            ..Limits::default()
        },
    ];
    let inputs = damaged(
        &bodies,
        &[
            0x00, 0x01, 0x7f, 0x80, 0x90, 0x92, 0x96, 0xc0, 0xc4, 0xc5, 0xcc, 0xd0, 0xdc, 0xff,
        ],
    );
    let mut fast = 0;
    for limits in &limits {
        for input in &inputs {
            let mut budget = limits.max_metadata_size;
            let Ok((_, _, c)) = decode_head(input, limits, &mut budget, &mut Vec::new()) else {
                continue;
            };
            let (mut b1, mut t1, mut r1) = (budget, Vec::new(), Vec::new());
            let small = small_tensors(c.rest, limits, &mut b1, &mut t1, &mut r1);
            let (mut b2, mut t2, mut r2) = (budget, Vec::new(), Vec::new());
            let mut gc = Cursor { rest: c.rest };
            let general = decode_tensors(&mut gc, limits, &mut b2, &mut t2, &mut r2);
            if small.is_some() {
                fast += 1;
                general.expect("the general decoder accepts it");
                assert_eq!((&t1, &r1, b1), (&t2, &r2, b2));
                assert_eq!(
                    (t1.capacity(), r1.capacity()),
                    (t2.capacity(), r2.capacity())
                );
            }
        }
    }
    assert!(
        fast > 2 * bodies.len(),
        "the straight-line path was taken {fast} times"
    );
}

/// A tensor list the straight-line decoder gives up on half way (the second tensor's
/// channel index is not a fixint) decodes whole, from the start of the list, with the whole
/// metadata budget: here exactly what its channel data takes.
#[test]
fn a_tensor_list_given_up_half_way_decodes_from_its_start() {
    let m = Message::new()
        .with_tensor(Tensor::cpu(vec![1; 8]))
        .with_tensor(Tensor::cpu(vec![2; 8]));
    let mut body = Vec::new();
    encode_descriptor(&mut body, 1, &m, |i, d| {
        if i == 0 {
            d.set(&[6; 3]);
            0
        } else {
            200
        }
    });
    let limits = Limits {
        max_metadata_size: 3,
        ..Limits::default()
    };
    let wd = decode_descriptor(&body, &limits).expect("decodes");
    assert_eq!(wd.routes, vec![(0, vec![6; 3]), (200, vec![])]);
    assert_eq!(wd.descriptor.tensors.len(), 2);
}

/// Every truncation of each body, and each body with each byte in turn set to each of
/// `bytes`.
fn damaged(bodies: &[Vec<u8>], bytes: &[u8]) -> Vec<Vec<u8>> {
    let mut inputs = Vec::new();
    for body in bodies {
        for cut in 0..=body.len() {
            inputs.push(body[..cut].to_vec());
        }
        for i in 0..body.len() {
            for &b in bytes {
                let mut v = body.clone();
                v[i] = b;
                inputs.push(v);
            }
        }
    }
    inputs
}

#[test]
fn limits_refuse_before_allocation() {
    let m = sample();
    let mut buf = Vec::new();
    encode_descriptor(&mut buf, 1, &m, |_, _| 0);
    let tight = Limits {
        max_tensors: 1,
        ..Limits::default()
    };
    assert_eq!(
        decode_descriptor(&buf, &tight),
        Err(WireError::Limit {
            limit: "tensor count",
            value: 2,
            max: 1
        })
    );
    let tight = Limits {
        max_metadata_size: 6,
        ..Limits::default()
    };
    assert!(matches!(
        decode_descriptor(&buf, &tight),
        Err(WireError::Limit {
            limit: "metadata size",
            ..
        })
    ));
    let tight = Limits {
        max_tensor_size: 32,
        ..Limits::default()
    };
    assert!(matches!(
        decode_descriptor(&buf, &tight),
        Err(WireError::Limit {
            limit: "tensor size",
            value: 33,
            ..
        })
    ));
}

#[test]
fn truncation_and_trailing_bytes_are_malformed() {
    let mut buf = Vec::new();
    encode_descriptor(&mut buf, 1, &sample(), |_, _| 0);
    for cut in 0..buf.len() {
        assert!(decode_descriptor(&buf[..cut], &Limits::default()).is_err());
    }
    buf.push(0);
    assert!(matches!(
        decode_descriptor(&buf, &Limits::default()),
        Err(WireError::Malformed(_))
    ));
}

#[test]
fn huge_sizes_are_legal_below_the_limit() {
    let m = Message::new();
    let mut buf = Vec::new();
    encode_descriptor(&mut buf, 0, &m, |_, _| 0);
    // Hand-build a tensor entry of 5 GiB: sizes are u64.
    let mut buf = Vec::new();
    put_array(&mut buf, 4);
    put_uint(&mut buf, 0);
    put_bin(&mut buf, b"");
    put_array(&mut buf, 0);
    put_array(&mut buf, 1);
    put_array(&mut buf, 6);
    put_uint(&mut buf, 5 << 30);
    put_uint(&mut buf, 0);
    let _ = rmp::encode::write_nil(&mut buf);
    put_uint(&mut buf, 0);
    put_bin(&mut buf, b"");
    put_bin(&mut buf, b"");
    let d = decode_descriptor(&buf, &Limits::default()).unwrap();
    assert_eq!(d.descriptor.tensors[0].length, 5 << 30);
}

#[test]
fn ack_round_trip() {
    let a = Ack {
        seq: 3,
        tensor: 1,
        ok: false,
    };
    let mut buf = Vec::new();
    encode_ack(&mut buf, &a);
    assert_eq!(decode_ack(&buf).unwrap(), a);
    assert!(decode_ack(&buf[..buf.len() - 1]).is_err());
}

#[test]
fn chunk_round_trip() {
    let h = ChunkHeader {
        seq: u64::MAX,
        tensor: 9,
        offset: 1 << 33,
        length: 12,
    };
    let mut buf = Vec::new();
    encode_chunk(&mut buf, &h);
    assert_eq!(decode_chunk(&buf).unwrap(), h);
    assert!(decode_chunk(&buf[..buf.len() - 1]).is_err());
}
