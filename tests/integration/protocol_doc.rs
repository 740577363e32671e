//! docs/protocol.md stays true to the code: every byte example in it decodes, with the real
//! decoder, to the frame the text says it is, and the real encoder writes exactly those bytes.
//! A change to a frame fails here until the document follows.
//!
//! An example is a line in a code block laid out as
//! `LL LL LL LL  KK  body...`: the four bytes of the length prefix, two spaces, the kind byte, two
//! spaces, then the body as hex bytes and `"quoted"` ASCII strings (their bytes, without the
//! quotes). Three spaces or more end the bytes; what follows is a comment.

use actorpipe::internal::negotiate::{
    Brochure, ChannelChoice, ChannelOffer, Choice, DevicePair, Hello, Join, Offer, Purpose,
};
use actorpipe::internal::wire::{
    decode_frame, encode_ack, encode_chunk, encode_descriptor, encode_frame, encode_serde, Ack,
    ChunkHeader, Farewell, Frame, FrameKind, Preamble, WireDescriptor,
};
use actorpipe::{Descriptor, Limits, Message, Payload, PayloadDescriptor, Tensor};
use actorpipe::{Device, TensorDescriptor};

const DOC: &str = include_str!("../../docs/protocol.md");

fn is_hex(s: &str) -> bool {
    s.len() == 2
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Whether `line` is laid out as a frame example.
fn is_example(line: &str) -> bool {
    let b = line.as_bytes();
    if b.len() < 15 {
        return false;
    }
    let groups_ok = (0..4).all(|i| is_hex(&line[i * 3..i * 3 + 2]))
        && &line[2..3] == " "
        && &line[5..6] == " "
        && &line[8..9] == " "
        && &line[11..13] == "  "
        && is_hex(&line[13..15]);
    groups_ok && (b.len() == 15 || line[15..].starts_with("  "))
}

/// The bytes of an example line (see the module comment).
fn parse_example(line: &str) -> Vec<u8> {
    let mut out = Vec::new();
    let mut rest = line;
    loop {
        let trimmed = rest.trim_start_matches(' ');
        let spaces = rest.len() - trimmed.len();
        if trimmed.is_empty() || (spaces >= 3 && !out.is_empty()) {
            return out;
        }
        rest = trimmed;
        if let Some(s) = rest.strip_prefix('"') {
            let end = s
                .find('"')
                .unwrap_or_else(|| panic!("unclosed string in {line:?}"));
            out.extend_from_slice(&s.as_bytes()[..end]);
            rest = &s[end + 1..];
        } else {
            let tok = rest.get(..2).unwrap_or(rest);
            assert!(is_hex(tok), "{tok:?} is not a hex byte in {line:?}");
            out.push(u8::from_str_radix(tok, 16).expect("hex"));
            rest = &rest[2..];
        }
    }
}

fn examples() -> Vec<(String, Vec<u8>)> {
    let mut in_block = false;
    let mut found = Vec::new();
    for line in DOC.lines() {
        if line.trim_start().starts_with("```") {
            in_block = !in_block;
            continue;
        }
        if in_block && is_example(line) {
            found.push((line.to_string(), parse_example(line)));
        }
    }
    found
}

/// The whole frame (prefix included) the real encoder writes for `f`.
fn encode(f: &Frame) -> Vec<u8> {
    let mut buf = Vec::new();
    match f {
        Frame::Hello(h) => encode_serde(&mut buf, FrameKind::Hello, h),
        Frame::Choice(c) => encode_serde(&mut buf, FrameKind::Choice, c),
        Frame::Reject(r) => encode_serde(&mut buf, FrameKind::Reject, r),
        Frame::Close(c) => encode_serde(&mut buf, FrameKind::Close, c),
        Frame::Join(j) => encode_serde(&mut buf, FrameKind::Join, j),
        Frame::Refuse(r) => encode_serde(&mut buf, FrameKind::Refuse, r),
        Frame::Ready => encode_frame(&mut buf, FrameKind::Ready, |_| {}),
        Frame::Ping => encode_frame(&mut buf, FrameKind::Ping, |_| {}),
        Frame::Chunk(h) => encode_frame(&mut buf, FrameKind::Chunk, |b| encode_chunk(b, h)),
        Frame::Ack(a) => encode_frame(&mut buf, FrameKind::Ack, |b| encode_ack(b, a)),
        Frame::Descriptor(w) => {
            let d = &w.descriptor;
            let msg = Message {
                metadata: d.metadata.clone(),
                payloads: d
                    .payloads
                    .iter()
                    .map(|p| Payload {
                        data: vec![0; p.length as usize],
                        metadata: p.metadata.clone(),
                    })
                    .collect(),
                tensors: d
                    .tensors
                    .iter()
                    .map(|t| Tensor {
                        metadata: t.metadata.clone(),
                        target_device: t.target_device,
                        ..Tensor::cpu(vec![0; t.length as usize])
                    })
                    .collect(),
            };
            encode_frame(&mut buf, FrameKind::Descriptor, |b| {
                encode_descriptor(b, w.seq, &msg, |i, data| {
                    data.set(&w.routes[i].1);
                    w.routes[i].0
                })
            })
        }
    }
    buf
}

/// How the bytes would be written in the document (strings as hex).
fn layout(bytes: &[u8]) -> String {
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<Vec<_>>();
    format!(
        "{}  {}  {}",
        hex(&bytes[..4]).join(" "),
        hex(&bytes[4..5]).join(" "),
        hex(&bytes[5..]).join(" ")
    )
}

const TOKEN: u64 = 0x0123_4567_89ab_cdef;

fn nonce() -> Vec<u8> {
    (0..32).collect()
}

fn cpu_descriptor(seq: u64, route: (u8, Vec<u8>)) -> Frame {
    Frame::Descriptor(WireDescriptor {
        seq,
        descriptor: Descriptor {
            metadata: b"m".to_vec(),
            payloads: vec![PayloadDescriptor {
                length: 3,
                metadata: vec![],
            }],
            tensors: vec![TensorDescriptor {
                length: 5,
                source_device: Device::Cpu,
                target_device: None,
                metadata: vec![],
            }],
        },
        routes: vec![route],
    })
}

/// What each example in the document is, in the order they appear.
fn expected() -> Vec<Frame> {
    let basic = |priority, connections| ChannelOffer {
        name: "basic".into(),
        priority,
        domain: String::new(),
        devices: DevicePair::CPU,
        connections,
    };
    vec![
        // Section 2: the handshake frames of two contexts restricted to tcp and basic.
        Frame::Hello(Hello {
            brochure: Brochure {
                transports: vec![Offer {
                    name: "tcp".into(),
                    priority: 0,
                    domain: String::new(),
                    addresses: vec![],
                }],
                channels: vec![basic(0, 0)],
                remote: true,
            },
            nonce: nonce(),
            proof: None,
        }),
        Frame::Choice(Choice {
            transport: "tcp".into(),
            channels: vec![ChannelChoice {
                name: "basic".into(),
                devices: DevicePair::CPU,
                connections: 0,
            }],
            token: TOKEN,
            proof: None,
            remote: true,
        }),
        Frame::Join(Join {
            token: TOKEN,
            purpose: Purpose::Control,
            proof: None,
        }),
        Frame::Join(Join {
            token: TOKEN,
            purpose: Purpose::Channel {
                channel: 0,
                lane: 1,
            },
            proof: None,
        }),
        Frame::Join(Join {
            token: TOKEN,
            purpose: Purpose::Remote,
            proof: None,
        }),
        Frame::Reject("no common transport".into()),
        Frame::Refuse("too many pending handshakes".into()),
        Frame::Ready,
        Frame::Close(Farewell {
            reason: "bye".into(),
            graceful: true,
        }),
        Frame::Ping,
        // Descriptor: basic, then xth from pipe 7.
        cpu_descriptor(0, (0, vec![])),
        cpu_descriptor(0, (0, 7u64.to_le_bytes().to_vec())),
        // Chunk.
        Frame::Chunk(ChunkHeader {
            seq: 0,
            tensor: 0,
            offset: 0,
            length: 5,
        }),
        Frame::Chunk(ChunkHeader {
            seq: 2,
            tensor: 0,
            offset: 349_526,
            length: 65_536,
        }),
        // Ack.
        Frame::Ack(Ack {
            seq: 3,
            tensor: 1,
            ok: true,
        }),
        Frame::Ack(Ack {
            seq: 3,
            tensor: 1,
            ok: false,
        }),
    ]
}

#[test]
fn every_frame_example_decodes_and_encodes_to_its_bytes() {
    let found = examples();
    let want = expected();
    let listing = found
        .iter()
        .map(|(l, _)| l.as_str())
        .collect::<Vec<_>>()
        .join("\n");
    assert_eq!(
        found.len(),
        want.len(),
        "docs/protocol.md has {} frame examples, this test knows {}: update both together.\n\
         The examples found:\n{listing}",
        found.len(),
        want.len()
    );
    let limits = Limits::default();
    for ((line, bytes), frame) in found.iter().zip(&want) {
        let real = encode(frame);
        assert_eq!(
            bytes,
            &real,
            "docs/protocol.md shows\n  {line}\nbut the encoder writes {frame:?} as\n  {}",
            layout(&real)
        );
        let len = u32::from_le_bytes(bytes[..4].try_into().expect("prefix")) as usize;
        assert_eq!(len, bytes.len() - 4, "length prefix of {line}");
        let decoded = decode_frame(&bytes[4..], &limits)
            .unwrap_or_else(|e| panic!("the decoder refuses\n  {line}\n{e:?}"));
        assert_eq!(&decoded, frame, "{line}");
    }
}

#[test]
fn the_preamble_example_is_ours() {
    let ours = Preamble::OURS.encode();
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<Vec<_>>();
    let line = format!(
        "{}  {}  {}",
        hex(&ours[..8]).join(" "),
        hex(&ours[8..12]).join(" "),
        hex(&ours[12..]).join(" ")
    );
    assert!(
        DOC.lines().any(|l| l == line),
        "docs/protocol.md should show the preamble as\n{line}"
    );
}

#[test]
fn the_documented_handshake_frame_limit_is_the_code_s() {
    let limit = actorpipe::internal::auth::HANDSHAKE_FRAME_LIMIT;
    assert_eq!(limit, 64 << 10, "update docs/protocol.md's \"64 KiB\"");
    assert!(DOC.contains("64 KiB"));
}

#[test]
fn the_parser_reads_strings_and_stops_at_comments() {
    assert!(is_example("05 00 00 00  08  93 03 01 c3      message 3"));
    assert!(is_example("01 00 00 00  09"));
    assert!(!is_example(
        "61 63 74 72 70 69 70 65  01 00 00 00  00 00 00 00"
    ));
    assert_eq!(
        parse_example("04 00 00 00  03  a2 \"a b\"   then a comment"),
        vec![4, 0, 0, 0, 3, 0xa2, b'a', b' ', b'b']
    );
}
