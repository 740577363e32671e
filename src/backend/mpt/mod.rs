//! The multiplexed-transport channel: N lanes (separate TCP connections, each of which may leave
//! from a different local address, i.e. a different NIC), each tensor striped across the lanes
//! and reassembled in place.
//!
//! Each lane carries its stripe as chunk frames on its own connection, so lanes proceed in
//! parallel and a slow lane does not stall the others' kernel buffers. Both sides compute the
//! same stripes from the tensor's length; the descriptor's channel data is that length (8 bytes,
//! LE), which the receiver checks against its buffer.
//!
//! Tensors of 1 to [`Mpt::inline_max`] bytes ([`INLINE_MAX`], 256 KiB, by default) do not use
//! the lanes: they travel after their descriptor on the pipe's own connection, as `basic`
//! tensors do, with empty channel data. For them the lanes would cost each side more system
//! calls and a completion from another thread than the striping saves.

pub(crate) mod driver;

use crate::channel::ChannelBackend;
use crate::negotiate::DevicePair;

/// The multi-lane TCP channel.
#[derive(Debug, Clone)]
pub struct Mpt {
    /// Connections per pipe.
    pub lanes: u32,
    /// Local addresses the dialing side's lanes leave from, one per NIC: lane `i` binds
    /// `sources[i % len]`. Empty: the routing table chooses.
    pub sources: Vec<std::net::IpAddr>,
    /// Tensors of 1 to this many bytes travel inline, after their descriptor on the pipe's
    /// connection, instead of on the lanes ([`INLINE_MAX`] by default; 0: every non-empty
    /// tensor on the lanes). The peers need not agree: the sender decides, and the receiver
    /// reads a tensor inline exactly when its channel data is empty.
    pub inline_max: u64,
}

impl Default for Mpt {
    fn default() -> Self {
        Mpt {
            lanes: 2,
            sources: Vec::new(),
            inline_max: INLINE_MAX,
        }
    }
}

impl crate::channel::sealed::Sealed for Mpt {
    fn plan(&self, at: &crate::channel::sealed::Plan) -> crate::channel::kind::ChannelKind {
        use crate::channel::kind::ChannelKind;
        ChannelKind::Mpt {
            chunk_size: at.chunk_size,
            inline_max: self.inline_max,
        }
    }
}

impl ChannelBackend for Mpt {
    fn name(&self) -> &'static str {
        "mpt"
    }

    fn priority(&self) -> i32 {
        10
    }

    fn domain(&self) -> String {
        String::new()
    }

    fn devices(&self) -> DevicePair {
        DevicePair::CPU
    }

    fn connections(&self) -> u32 {
        self.lanes.max(1)
    }

    fn lane_source(&self, lane: u32) -> Option<std::net::IpAddr> {
        (!self.sources.is_empty()).then(|| self.sources[lane as usize % self.sources.len()])
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
}

/// Stripes below this size are not split further: one lane moves small tensors whole.
pub const MIN_STRIPE: u64 = 64 << 10;

/// The largest tensor that travels inline on the pipe's connection by default
/// ([`Mpt::inline_max`]), as for cma over tcp. On the 16-core machine (2 lanes, each on a thread
/// of its own) a 128 KiB and a 256 KiB tensor's round trip took 91 and 135 µs inline against
/// 140–147 and 171–181 µs striped over the lanes; at 512 KiB the two were even and at 1 MiB the
/// lanes were faster (git history's docs/performance-many-cores.md, "mpt's small tensors
/// inline").
pub const INLINE_MAX: u64 = 256 << 10;

/// Splits `len` bytes into at most `lanes` contiguous `(lane, offset, length)` stripes, none
/// empty and none (but a whole small tensor) below [`MIN_STRIPE`]. Zero bytes give no stripe.
pub fn stripes(len: u64, lanes: u32) -> impl Iterator<Item = (u32, u64, u64)> {
    let lanes = (lanes.max(1) as u64).min(len.div_ceil(MIN_STRIPE)).max(1);
    let per = len.div_ceil(lanes).max(1);
    (0..lanes).filter_map(move |i| {
        let offset = i * per;
        (offset < len).then(|| (i as u32, offset, per.min(len - offset)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stripes_cover_exactly() {
        assert_eq!(stripes(0, 4).count(), 0);
        assert_eq!(stripes(10, 4).collect::<Vec<_>>(), vec![(0, 0, 10)]);
        let v: Vec<_> = stripes(1 << 20, 4).collect();
        assert_eq!(v.len(), 4);
        assert_eq!(v.iter().map(|s| s.2).sum::<u64>(), 1 << 20);
        for w in v.windows(2) {
            assert_eq!(w[0].1 + w[0].2, w[1].1);
        }
        let v: Vec<_> = stripes(3 * MIN_STRIPE + 1, 8).collect();
        assert_eq!(v.len(), 4);
        assert_eq!(v.iter().map(|s| s.2).sum::<u64>(), 3 * MIN_STRIPE + 1);
    }
}
