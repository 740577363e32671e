//! Frame kinds, encoding into a reusable buffer, and decoding with limits.

use super::descriptor::{
    decode_ack, decode_chunk, decode_descriptor, Ack, ChunkHeader, WireDescriptor,
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

fn serde_body<T: serde::de::DeserializeOwned>(body: &[u8], what: &str) -> Result<T, WireError> {
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
    let (&k, body) = bytes
        .split_first()
        .ok_or_else(|| WireError::Malformed("empty frame".into()))?;
    let kind = FrameKind::from_byte(k)
        .ok_or_else(|| WireError::Malformed(format!("unknown frame kind {k}")))?;
    Ok(match kind {
        FrameKind::Hello => Frame::Hello(serde_body(body, "hello")?),
        FrameKind::Choice => Frame::Choice(serde_body(body, "choice")?),
        FrameKind::Reject => Frame::Reject(serde_body(body, "reject")?),
        FrameKind::Descriptor => Frame::Descriptor(decode_descriptor(body, limits)?),
        FrameKind::Chunk => Frame::Chunk(decode_chunk(body)?),
        FrameKind::Close => Frame::Close(serde_body(body, "close")?),
        FrameKind::Join => Frame::Join(serde_body(body, "join")?),
        FrameKind::Ack => Frame::Ack(decode_ack(body)?),
        FrameKind::Ping if body.is_empty() => Frame::Ping,
        FrameKind::Ping => {
            return Err(WireError::Malformed(format!(
                "malformed ping frame: {} unexpected bytes",
                body.len()
            )))
        }
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
