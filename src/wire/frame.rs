//! Frame kinds, encoding into a reusable buffer, and decoding with limits.

use super::descriptor::{
    decode_ack, decode_chunk, decode_descriptor_reusing, Ack, ChunkHeader, WireDescriptor,
};
use super::{Limits, WireError, LEN_PREFIX};
use crate::negotiate::{Choice, Hello, Join};

/// The byte after a frame's length prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    /// Each side's brochure (handshake).
    Hello = 1,
    /// The connecting side's choice of backends (handshake).
    Choice = 2,
    /// A refusal during the handshake, with a reason.
    Reject = 3,
    /// A message descriptor; payload bytes follow.
    Descriptor = 4,
    /// A piece of a tensor moved over the control connection; its bytes follow.
    Chunk = 5,
    /// The sender closes the pipe, with a reason.
    Close = 6,
    /// An extra connection joins a pipe being set up (control stream on another transport, or a
    /// channel's own connection).
    Join = 7,
    /// A channel's receiver tells the sender a tensor is done (or must be resent another way).
    Ack = 8,
    /// A heartbeat: the sender is alive (sent by an idle writer; skipped by every reader).
    Ping = 9,
    /// The listener turns a pipe away for now (admission: too many pending handshakes, out of
    /// file descriptors, joins not in time), with a reason; the connecting side may retry later.
    Refuse = 10,
    /// The listener has accepted the whole pipe, every join included (no body).
    Ready = 11,
}

/// A whole heartbeat frame: length prefix 1, kind [`FrameKind::Ping`], no body.
pub const PING_FRAME: [u8; LEN_PREFIX + 1] = [1, 0, 0, 0, FrameKind::Ping as u8];

impl FrameKind {
    fn from_byte(b: u8) -> Option<Self> {
        Some(match b {
            1 => FrameKind::Hello,
            2 => FrameKind::Choice,
            3 => FrameKind::Reject,
            4 => FrameKind::Descriptor,
            5 => FrameKind::Chunk,
            6 => FrameKind::Close,
            7 => FrameKind::Join,
            8 => FrameKind::Ack,
            9 => FrameKind::Ping,
            10 => FrameKind::Refuse,
            11 => FrameKind::Ready,
            _ => return None,
        })
    }
}

/// A decoded frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// Handshake: the peer's brochure.
    Hello(Hello),
    /// Handshake: the connecting side's choice.
    Choice(Choice),
    /// Handshake refused.
    Reject(String),
    /// A message descriptor.
    Descriptor(WireDescriptor),
    /// A tensor piece header.
    Chunk(ChunkHeader),
    /// The peer closes the pipe.
    Close(Farewell),
    /// A connection joins a pipe.
    Join(Join),
    /// A channel acknowledgement.
    Ack(Ack),
    /// A heartbeat.
    Ping,
    /// The listener turns the pipe away for now, with a reason.
    Refuse(String),
    /// The listener has accepted the whole pipe.
    Ready,
}

impl Frame {
    /// The frame's kind.
    pub fn kind(&self) -> FrameKind {
        match self {
            Frame::Hello(_) => FrameKind::Hello,
            Frame::Choice(_) => FrameKind::Choice,
            Frame::Reject(_) => FrameKind::Reject,
            Frame::Descriptor(_) => FrameKind::Descriptor,
            Frame::Chunk(_) => FrameKind::Chunk,
            Frame::Close(_) => FrameKind::Close,
            Frame::Join(_) => FrameKind::Join,
            Frame::Ack(_) => FrameKind::Ack,
            Frame::Ping => FrameKind::Ping,
            Frame::Refuse(_) => FrameKind::Refuse,
            Frame::Ready => FrameKind::Ready,
        }
    }
}

/// The body of a `Close` frame.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Farewell {
    /// Why the sender closes.
    pub reason: String,
    /// `true` after a graceful close (every write of the sender completed first); `false` for
    /// an abort, or a close forced by an error.
    pub graceful: bool,
}

/// Appends one whole frame (length prefix, kind, body) to `buf`; `body` writes the body.
///
/// `buf` is meant to be reused: after the first messages it has the capacity it needs and
/// encoding allocates nothing.
pub fn encode_frame(buf: &mut Vec<u8>, kind: FrameKind, body: impl FnOnce(&mut Vec<u8>)) {
    let start = buf.len();
    buf.extend_from_slice(&[0; LEN_PREFIX]);
    buf.push(kind as u8);
    body(buf);
    let len = (buf.len() - start - LEN_PREFIX) as u32;
    buf[start..start + LEN_PREFIX].copy_from_slice(&len.to_le_bytes());
}

/// Appends a serde-encoded frame (handshake and close frames).
pub fn encode_serde(buf: &mut Vec<u8>, kind: FrameKind, value: &impl serde::Serialize) {
    // Encoding plain structs and strings into a Vec cannot fail.
    encode_frame(buf, kind, |b| {
        let _ = rmp_serde::encode::write(b, value);
    });
}

/// Walks the MessagePack value at the start of `body` without decoding it, refusing any
/// announced length that the bytes left cannot hold: every element of an array or map takes at
/// least one byte, every string or binary its length. rmp-serde reserves capacity from announced
/// counts (up to 1 MiB per sequence), so this check, made first, bounds what a serde frame can
/// make us allocate by its own size.
fn check_lengths(body: &[u8], what: &str) -> Result<(), WireError> {
    let bad = |why: String| WireError::Malformed(format!("malformed {what} frame: {why}"));
    let mut pos = 0usize;
    // Values still to read; each needs at least one byte.
    let mut pending: u64 = 1;
    let take = |pos: &mut usize, n: usize| -> Result<u64, WireError> {
        let bytes = body
            .get(*pos..*pos + n)
            .ok_or_else(|| bad("truncated".into()))?;
        *pos += n;
        Ok(bytes.iter().fold(0u64, |v, &b| v << 8 | b as u64))
    };
    while pending > 0 {
        let marker = *body.get(pos).ok_or_else(|| bad("truncated".into()))?;
        pos += 1;
        pending -= 1;
        // (elements announced, bytes announced)
        let (elements, bytes) = match marker {
            0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => (0, 0),
            0x80..=0x8f => (2 * (marker & 0x0f) as u64, 0),
            0x90..=0x9f => ((marker & 0x0f) as u64, 0),
            0xa0..=0xbf => (0, (marker & 0x1f) as u64),
            0xc1 => return Err(bad("reserved byte 0xc1".into())),
            0xc4 | 0xd9 => (0, take(&mut pos, 1)?),
            0xc5 | 0xda => (0, take(&mut pos, 2)?),
            0xc6 | 0xdb => (0, take(&mut pos, 4)?),
            0xc7 => (0, take(&mut pos, 1)? + 1),
            0xc8 => (0, take(&mut pos, 2)? + 1),
            0xc9 => (0, take(&mut pos, 4)? + 1),
            0xca | 0xce | 0xd2 => (0, 4),
            0xcb | 0xcf | 0xd3 => (0, 8),
            0xcc | 0xd0 => (0, 1),
            0xcd | 0xd1 => (0, 2),
            0xd4..=0xd8 => (0, 1 + (1u64 << (marker - 0xd4))),
            0xdc => (take(&mut pos, 2)?, 0),
            0xdd => (take(&mut pos, 4)?, 0),
            0xde => (2 * take(&mut pos, 2)?, 0),
            0xdf => (2 * take(&mut pos, 4)?, 0),
        };
        let left = (body.len() - pos) as u64;
        if bytes > left {
            return Err(bad(format!("{bytes} bytes announced, {left} left")));
        }
        pos += bytes as usize;
        pending += elements;
        if pending > left - bytes {
            return Err(bad(format!(
                "{elements} elements announced, {} bytes left",
                left - bytes
            )));
        }
    }
    Ok(())
}

/// The most a handshake frame (decoded with serde) reserves per byte of its own length, at each
/// nesting level: serde reserves a sequence's capacity from its announced count, the decoder
/// refuses counts larger than the bytes left, so a sequence reserves at most one element per
/// byte. This is the largest element of any sequence in those frames.
pub const SERDE_RESERVE_PER_BYTE: usize = {
    use crate::negotiate::{ChannelChoice, ChannelOffer, DevicePair, Offer};
    use std::mem::size_of;
    let sizes = [
        size_of::<Offer>(),
        size_of::<ChannelOffer>(),
        size_of::<ChannelChoice>(),
        size_of::<DevicePair>(),
        size_of::<String>(),
    ];
    let mut max = 0;
    let mut i = 0;
    while i < sizes.len() {
        if sizes[i] > max {
            max = sizes[i];
        }
        i += 1;
    }
    max
};

fn serde_body<T: serde::de::DeserializeOwned>(body: &[u8], what: &str) -> Result<T, WireError> {
    check_lengths(body, what)?;
    let mut rest = body;
    let v = rmp_serde::decode::from_read(&mut rest)
        .map_err(|e| WireError::Malformed(format!("malformed {what} frame: {e}")))?;
    if !rest.is_empty() {
        return Err(WireError::Malformed(format!(
            "malformed {what} frame: {} trailing bytes",
            rest.len()
        )));
    }
    Ok(v)
}

/// Decodes a frame from its bytes after the length prefix (kind byte, then body).
pub fn decode_frame(bytes: &[u8], limits: &Limits) -> Result<Frame, WireError> {
    decode_frame_reusing(bytes, limits, &mut None)
}

/// [`decode_frame`], decoding a descriptor into the lists of `spare`, a descriptor done with
/// (see [`decode_descriptor_reusing`](super::decode_descriptor_reusing)); a frame of another
/// kind leaves it.
pub fn decode_frame_reusing(
    bytes: &[u8],
    limits: &Limits,
    spare: &mut Option<WireDescriptor>,
) -> Result<Frame, WireError> {
    let (&k, body) = bytes
        .split_first()
        .ok_or_else(|| WireError::Malformed("empty frame".into()))?;
    let kind = FrameKind::from_byte(k)
        .ok_or_else(|| WireError::Malformed(format!("unknown frame kind {k}")))?;
    Ok(match kind {
        FrameKind::Hello => Frame::Hello(serde_body(body, "hello")?),
        FrameKind::Choice => Frame::Choice(serde_body(body, "choice")?),
        FrameKind::Reject => Frame::Reject(serde_body(body, "reject")?),
        FrameKind::Descriptor => Frame::Descriptor(decode_descriptor_reusing(body, limits, spare)?),
        FrameKind::Chunk => Frame::Chunk(decode_chunk(body)?),
        FrameKind::Close => Frame::Close(serde_body(body, "close")?),
        FrameKind::Join => Frame::Join(serde_body(body, "join")?),
        FrameKind::Ack => Frame::Ack(decode_ack(body)?),
        FrameKind::Refuse => Frame::Refuse(serde_body(body, "refuse")?),
        FrameKind::Ping | FrameKind::Ready if !body.is_empty() => {
            return Err(WireError::Malformed(format!(
                "malformed {} frame: {} unexpected bytes",
                if kind == FrameKind::Ping {
                    "ping"
                } else {
                    "ready"
                },
                body.len()
            )))
        }
        FrameKind::Ping => Frame::Ping,
        FrameKind::Ready => Frame::Ready,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::negotiate::Brochure;

    fn round_trip(buf: &[u8]) -> Frame {
        let len = u32::from_le_bytes(buf[..4].try_into().unwrap()) as usize;
        assert_eq!(len, buf.len() - 4);
        decode_frame(&buf[4..], &Limits::default()).unwrap()
    }

    #[test]
    fn serde_frames_round_trip() {
        let hello = Hello {
            brochure: Brochure::default(),
            nonce: vec![7; 32],
            proof: Some(serde_bytes::ByteBuf::from(vec![1, 2, 3])),
        };
        let mut buf = Vec::new();
        encode_serde(&mut buf, FrameKind::Hello, &hello);
        assert_eq!(round_trip(&buf), Frame::Hello(hello));
        buf.clear();
        let bye = Farewell {
            reason: "bye".into(),
            graceful: true,
        };
        encode_serde(&mut buf, FrameKind::Close, &bye);
        assert_eq!(round_trip(&buf), Frame::Close(bye));
        assert_eq!(round_trip(&buf).kind(), FrameKind::Close);
    }

    #[test]
    fn announced_lengths_must_fit_in_the_frame() {
        // A hello whose brochure announces 2^32 - 1 transports in 8 bytes.
        let e = decode_frame(
            &[1, 0x91, 0x92, 0xdd, 0xff, 0xff, 0xff, 0xff],
            &Limits::default(),
        );
        assert!(
            matches!(&e, Err(WireError::Malformed(m)) if m.contains("elements announced")),
            "{e:?}"
        );
        // A reject whose reason announces 65 535 bytes.
        let e = decode_frame(&[3, 0xda, 0xff, 0xff, b'a'], &Limits::default());
        assert!(
            matches!(&e, Err(WireError::Malformed(m)) if m.contains("bytes announced")),
            "{e:?}"
        );
        // Every kind of value in a well-formed body passes the walk.
        let body = [
            0x9f, 0x01, 0xe0, 0xc0, 0xc3, 0xa1, b'a', 0xc4, 0x01, 0x00, 0xd9, 0x00, 0xcb, 0, 0, 0,
            0, 0, 0, 0, 0, 0xd4, 0x01, 0x02, 0xc7, 0x01, 0x05, 0x07, 0xdc, 0x00, 0x01, 0x00, 0xde,
            0x00, 0x00, 0x81, 0x01, 0x02, 0x90, 0xd1, 0x00, 0x00,
        ];
        check_lengths(&body, "test").unwrap();
        assert!(check_lengths(&body[..body.len() - 1], "test").is_err());
        assert!(check_lengths(&[0xc1], "test").is_err());
    }

    #[test]
    fn ping_is_five_bytes_with_no_body() {
        assert_eq!(round_trip(&PING_FRAME), Frame::Ping);
        assert_eq!(Frame::Ping.kind(), FrameKind::Ping);
        assert!(decode_frame(&[9, 0], &Limits::default()).is_err());
    }

    #[test]
    fn unknown_kind_and_garbage_are_malformed() {
        assert!(matches!(
            decode_frame(&[99, 1, 2], &Limits::default()),
            Err(WireError::Malformed(_))
        ));
        assert!(decode_frame(&[], &Limits::default()).is_err());
        assert!(decode_frame(&[1, 0xff, 0xff], &Limits::default()).is_err());
        assert!(decode_frame(&[6, 0xa3, b'a'], &Limits::default()).is_err());
    }
}
