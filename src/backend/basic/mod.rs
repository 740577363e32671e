//! The basic channel: tensor bytes over the pipe's own connection, in chunks.
//!
//! Each chunk is a `Chunk` frame (message sequence number, tensor index, offset, length) followed
//! by that many raw bytes, written straight from the sender's buffer and read straight into the
//! receiver's buffer. Chunking bounds the size of one write and lets the receiver check every
//! piece against what it expects; a zero-length tensor sends no chunk at all.

use crate::channel::ChannelBackend;
use crate::negotiate::DevicePair;

/// Default bytes per chunk.
pub const DEFAULT_CHUNK_SIZE: usize = 4 << 20;

/// The basic CPU channel.
#[derive(Debug, Clone, Copy, Default)]
pub struct Basic;

impl crate::channel::sealed::Sealed for Basic {
    fn plan(&self, at: &crate::channel::sealed::Plan) -> crate::channel::kind::ChannelKind {
        use crate::channel::kind::ChannelKind;
        ChannelKind::Basic {
            chunk_size: at.chunk_size,
        }
    }
}

impl ChannelBackend for Basic {
    fn name(&self) -> &'static str {
        "basic"
    }

    fn priority(&self) -> i32 {
        0
    }

    fn domain(&self) -> String {
        String::new()
    }

    fn devices(&self) -> DevicePair {
        DevicePair::CPU
    }
}

/// Splits `len` bytes into `(offset, length)` pieces of at most `chunk` bytes (a chunk of 0 is
/// taken as 1). Zero bytes give no piece.
pub fn chunks(len: u64, chunk: u64) -> impl Iterator<Item = (u64, u64)> {
    let chunk = chunk.max(1);
    (0..len.div_ceil(chunk)).map(move |i| {
        let offset = i * chunk;
        (offset, chunk.min(len - offset))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_buffer_exactly() {
        assert_eq!(chunks(0, 4).count(), 0);
        assert_eq!(chunks(1, 4).collect::<Vec<_>>(), vec![(0, 1)]);
        assert_eq!(chunks(8, 4).collect::<Vec<_>>(), vec![(0, 4), (4, 4)]);
        assert_eq!(
            chunks(9, 4).collect::<Vec<_>>(),
            vec![(0, 4), (4, 4), (8, 1)]
        );
        assert_eq!(chunks(3, 0).count(), 3);
        let big = 5u64 << 30;
        let total: u64 = chunks(big, 1 << 30).map(|(_, l)| l).sum();
        assert_eq!(total, big);
    }
}
