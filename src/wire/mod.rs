//! Wire protocol v1: the bytes on a pipe's control connection.
//!
//! A connection starts with a 16-byte [`Preamble`] from each side (magic, version), so that a
//! version mismatch or a stranger is recognised before any frame is decoded. After it, everything
//! is a frame:
//!
//! ```text
//! [u32 LE length][u8 kind][MessagePack body]     length counts kind + body
//! ```
//!
//! The handshake frames (`Hello`, `Choice`, `Reject`, `Close`) are serde structs encoded with
//! rmp-serde. The two per-message frames (`Descriptor`, `Chunk`) are encoded and decoded by hand
//! with `rmp`, in the same MessagePack, so that encoding allocates nothing and decoding checks
//! every count and size against [`Limits`] before it allocates for it. Raw payload and tensor
//! bytes follow their frames unframed; their sizes are known from the frame before them.
//!
//! docs/protocol.md is the prose version of this module.

mod descriptor;
mod frame;

pub use descriptor::{
    decode_ack, decode_chunk, decode_descriptor, decode_descriptor_reusing, encode_ack,
    encode_chunk, encode_descriptor, Ack, ChannelData, ChunkHeader, WireDescriptor,
};
pub use frame::{
    decode_frame, decode_frame_reusing, encode_frame, encode_serde, Farewell, Frame, FrameKind,
    PING_FRAME, SERDE_RESERVE_PER_BYTE,
};

use crate::error::{Error, Origin};

/// First bytes each side sends.
pub const MAGIC: [u8; 8] = *b"actrpipe";
/// The protocol version this build speaks.
pub const VERSION: u32 = 1;
/// Length of the preamble in bytes.
pub const PREAMBLE_LEN: usize = 16;
/// Length of a frame's length prefix.
pub const LEN_PREFIX: usize = 4;

/// The connection preamble: magic, protocol version, reserved flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Preamble {
    /// The sender's protocol version.
    pub version: u32,
}

impl Preamble {
    /// This build's preamble.
    pub const OURS: Preamble = Preamble { version: VERSION };

    /// The 16 bytes on the wire.
    pub fn encode(&self) -> [u8; PREAMBLE_LEN] {
        let mut b = [0u8; PREAMBLE_LEN];
        b[..8].copy_from_slice(&MAGIC);
        b[8..12].copy_from_slice(&self.version.to_le_bytes());
        b
    }

    /// Parses a peer's preamble; a wrong magic or another version is an error.
    pub fn check(bytes: &[u8; PREAMBLE_LEN], origin: &Origin) -> Result<Preamble, Error> {
        if bytes[..8] != MAGIC {
            return Err(Error::protocol(
                "the peer is not an actorpipe peer (bad magic in preamble)",
                origin,
            ));
        }
        let version = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]);
        if version != VERSION {
            return Err(Error::Version {
                ours: VERSION,
                theirs: version,
                origin: origin.clone(),
            });
        }
        Ok(Preamble { version })
    }
}

/// Bounds on what a peer may announce, all checked before anything is allocated for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest control frame (descriptor, handshake, chunk header), in bytes.
    pub max_frame_size: u32,
    /// Most payloads in one message.
    pub max_payloads: u32,
    /// Most tensors in one message.
    pub max_tensors: u32,
    /// Most metadata bytes in one message, all metadata fields together.
    pub max_metadata_size: u64,
    /// Largest payload, in bytes.
    pub max_payload_size: u64,
    /// Largest tensor, in bytes.
    pub max_tensor_size: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_frame_size: 4 << 20,
            max_payloads: 1024,
            max_tensors: 4096,
            max_metadata_size: 2 << 20,
            max_payload_size: 1 << 30,
            max_tensor_size: 1 << 40,
        }
    }
}

/// Why a frame was refused; the caller adds where it happened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WireError {
    /// The bytes do not decode as the frame they claim to be.
    Malformed(String),
    /// A count or size is over a limit.
    Limit {
        /// Which limit.
        limit: &'static str,
        /// The announced value.
        value: u64,
        /// The maximum.
        max: u64,
    },
}

impl WireError {
    /// The runtime error for this refusal, at `origin`.
    pub fn at(self, origin: &Origin) -> Error {
        match self {
            WireError::Malformed(detail) => Error::protocol(detail, origin),
            WireError::Limit { limit, value, max } => Error::LimitExceeded {
                limit,
                value,
                max,
                origin: origin.clone(),
            },
        }
    }
}

/// Checks a frame's announced length (the value of its prefix) before its buffer is allocated.
pub fn check_frame_len(len: u32, limits: &Limits) -> Result<usize, WireError> {
    if len == 0 {
        return Err(WireError::Malformed("empty frame".into()));
    }
    if len > limits.max_frame_size {
        return Err(WireError::Limit {
            limit: "frame size",
            value: len as u64,
            max: limits.max_frame_size as u64,
        });
    }
    Ok(len as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preamble_round_trip_and_refusals() {
        let o = Origin::default();
        let ours = Preamble::OURS.encode();
        assert_eq!(Preamble::check(&ours, &o).unwrap(), Preamble::OURS);
        let mut v2 = ours;
        v2[8] = 2;
        assert!(matches!(
            Preamble::check(&v2, &o),
            Err(Error::Version {
                ours: 1,
                theirs: 2,
                ..
            })
        ));
        let mut junk = ours;
        junk[0] = b'X';
        assert!(matches!(
            Preamble::check(&junk, &o),
            Err(Error::Protocol { .. })
        ));
    }

    #[test]
    fn frame_length_is_checked() {
        let l = Limits::default();
        assert!(check_frame_len(0, &l).is_err());
        assert_eq!(check_frame_len(10, &l).unwrap(), 10);
        assert_eq!(
            check_frame_len(u32::MAX, &l),
            Err(WireError::Limit {
                limit: "frame size",
                value: u32::MAX as u64,
                max: l.max_frame_size as u64
            })
        );
    }
}
